"""ringtrain as a torch.distributed backend.

::

    import torch.distributed as dist
    import ringtrain.torch                      # registers the backend "ringtrain"
    dist.init_process_group("ringtrain")        # under mpiexec or ringtrain-run
    model = torch.nn.parallel.DistributedDataParallel(model)

Every torch.distributed call on a group of this backend is carried out by ringtrain's
own collectives (see :mod:`ringtrain.torch.process_group`), with ringtrain's agreement
check: ranks that disagree raise the same error on every rank instead of hanging. Under
MPI's launcher ``init_process_group`` needs no variable (see
:mod:`ringtrain.torch._rendezvous`). :func:`fp16_hook` and :func:`bf16_hook` are DDP
communication hooks with ringtrain's compression. See docs/torch.md.

Importing this module registers the backend and starts nothing: MPI starts at
``init_process_group``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

import torch.distributed as dist

from . import _rendezvous
from ._name import BACKEND_NAME

__all__ = ["BACKEND_NAME", "ProcessGroupRingtrain", "bf16_hook", "fp16_hook",
           "process_set_of"]

_LAZY = {"ProcessGroupRingtrain": ".process_group", "process_set_of": ".process_group",
         "fp16_hook": ".hooks", "bf16_hook": ".hooks"}


def _create(options: Any, backend_options: Any) -> dist.ProcessGroup:
    from .process_group import create  # starts MPI: only when a group is made

    return create(options, backend_options)


def _register() -> None:
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    _rendezvous.install()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_register()
