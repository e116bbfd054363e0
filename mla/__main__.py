"""``python -m mla``: the same commands as the ``mla`` console script."""

from mla.tools.cli import main

raise SystemExit(main())
