"""``python -m mla``: the same commands as the ``mla`` console script."""

from mla.cli import main

raise SystemExit(main())
