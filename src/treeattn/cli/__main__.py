from treeattn.cli.main import main

raise SystemExit(main())
