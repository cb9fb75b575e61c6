"""Intakes: where requests come from. Each turns its protocol into ``SayRequest``s for the ledger.

``mqtt`` (say, stop, pool, Hermes; the broker link itself is ``s2s_daemon.mqtt``), ``wyoming``
(Home Assistant's Assist), ``http`` (the OpenAI-compatible speech API), and ``schemas``, the
say-payload rules they share. An intake that answers with audio gives its requests a
``CallerStream`` (``pipeline/output.py``) as their output. An intake never imports ``audio/``:
the speaker is the playback stage's alone.
"""
