"""The domain core, below every stage and door: what a request is and what becomes of it.

The ledger (``jobs.py``: the one owner of every request's state), the journal (``journal.py``),
the voices (``voices.py``, ``voice_edits.py``), a streamed text (``textfeed.py``, read through
the text stage of ``text/``, its neighbour in the same row; ``segment.py``),
pacing (``pacing.py``), the caller's audio (``output.py``, ``stretch.py``), the typed messages
between stages (``messages.py``), the request queue and the bounded channels. It imports no stage,
no door and no device.
"""
