from s2s_daemon.cli import main

raise SystemExit(main())
