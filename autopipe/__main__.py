"""``python -m autopipe``: the same command line as the ``autopipe`` script."""
from .cli import main

raise SystemExit(main())
