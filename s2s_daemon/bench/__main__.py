"""``python -m s2s_daemon.bench``: the ``bench`` subcommand without the rest of the command line."""

from s2s_daemon.bench.cli import main

raise SystemExit(main())
