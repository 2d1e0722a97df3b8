"""``python -m ringtrain.launcher``: the same as ``ringtrain-run``."""

import sys

from .cli import main

sys.exit(main())
