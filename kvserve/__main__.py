from kvserve.cli import main

raise SystemExit(main())
