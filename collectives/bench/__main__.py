"""``python -m ringtrain.collectives.bench``: the same as ``ringtrain-bench``."""

import sys

from .cli import main

sys.exit(main())
