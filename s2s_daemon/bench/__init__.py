"""``s2s-daemon bench``: compare engines, quantizations and dtypes on this machine.

Each configuration runs in its own worker process (so peak memory is its own) that
loads the engine once through the registry and then serves run requests as JSON
lines; the parent interleaves runs across the workers so machine drift hits all
configurations alike.
"""
