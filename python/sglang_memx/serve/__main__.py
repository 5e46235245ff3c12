"""``python -m sglang_memx.serve --config models.yaml``: same as ``sglang-memx serve``."""

import sys

from .main import main

sys.exit(main())
