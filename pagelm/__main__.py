from pagelm.cli import main

raise SystemExit(main())
