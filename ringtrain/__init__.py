"""ringtrain: data-parallel training over MPI.

The public API: ``import ringtrain as rt; rt.init(); rt.allreduce(grad)``. Everything
here is re-exported from the subpackages (``ringtrain.collectives`` for now).
"""

from importlib.metadata import PackageNotFoundError, version as _version

from .collectives import *  # noqa: F401,F403  (the facade re-exports the public API)
from .collectives import __all__ as _collectives_all

try:
    __version__ = _version("ringtrain")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__", *_collectives_all]
