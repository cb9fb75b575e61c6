"""``python -m tests.support.tone_daemon ARGS``: the real CLI with the tone engine registered."""

from __future__ import annotations

from tests.support.tone_engine import register

register()

from s2s_daemon.cli import main  # noqa: E402  (the engine must be registered first)

raise SystemExit(main())
