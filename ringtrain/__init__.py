"""ringtrain: data-parallel training over MPI.

The public API: ``import ringtrain as rt; rt.init(); rt.allreduce(grad)``. Its names
are those of ``ringtrain.collectives.__all__`` and ``ringtrain.trainer.__all__``,
imported on first use, so importing ``ringtrain`` (or ``ringtrain.launcher``) alone
neither imports mpi4py nor starts MPI.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version as _version
from typing import Any

try:
    __version__ = _version("ringtrain")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

_SUBPACKAGES = ("collectives", "kernels", "trainer", "launcher", "kvstore", "common", "torch",
                "elastic", "pruning", "pipeline", "balance", "horovod")


def __getattr__(name: str) -> Any:
    # Dunder probes and subpackages not yet imported must not pull in MPI: the import
    # system asks for ``launcher`` here before it imports ringtrain.launcher.
    if name in _SUBPACKAGES or (name.startswith("__") and name != "__all__"):
        raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
    trainer = import_module(".trainer", __name__)
    if name in trainer.__all__:
        value = getattr(trainer, name)
        globals()[name] = value
        return value
    collectives = import_module(".collectives", __name__)
    if name == "__all__":
        # ``join`` is in both: the trainer's (a context manager around training steps)
        # is the one at the top level; the collective is ringtrain.collectives.join.
        return list(dict.fromkeys(["__version__", *collectives.__all__, *trainer.__all__]))
    if name in collectives.__all__:
        value = getattr(collectives, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
