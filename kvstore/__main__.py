from kvstore.cli.main import main

raise SystemExit(main())
