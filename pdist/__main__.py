"""``python -m pdist``: the command line, :func:`pdist.cli.main`."""

from pdist.cli import main

raise SystemExit(main())
