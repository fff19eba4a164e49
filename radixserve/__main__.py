from radixserve.cli import main

raise SystemExit(main())
