"""``import ringtrain.horovod as hvd``: Horovod's PyTorch API on ringtrain.

See :mod:`ringtrain.trainer.horovod` and docs/horovod.md.
"""

from ringtrain.trainer.horovod import *  # noqa: F401,F403 (the facade re-exports the API)
from ringtrain.trainer.horovod import __all__  # noqa: F401
