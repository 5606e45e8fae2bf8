from unifit.cli.main import main

raise SystemExit(main())
