"""``python -m pdist``: the command line, ``pdist.cli.main``."""

from pdist.cli import main

raise SystemExit(main())
