from unifit.trainer.cli import main

raise SystemExit(main())
