"""``python -m memory_ext.pool.arbiter``: run the arbiter as its own process (``cli.main``)."""

from .cli import main

raise SystemExit(main())
