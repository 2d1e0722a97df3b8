"""Start every rank from the same state: broadcast parameters and optimizer state.

Data-parallel training needs every rank to hold the same weights and the same optimizer
state before the first step; otherwise the ranks' models drift apart. After building
the model (and loading a checkpoint on one rank, if resuming)::

    import ringtrain as rt

    rt.init()
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if rt.rank() == 0:
        load_checkpoint(model, optimizer)
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(optimizer, root_rank=0)

Every tensor travels with its own in-place ``ringtrain.broadcast_``, named by its
parameter name or by its path in the optimizer's state dict (``"state.3.exp_avg"``), so
a rank whose model differs from the root's gets a :class:`~ringtrain.MismatchError`
naming the tensor. A broadcast only copies bits, so dtypes that the collectives do not
move themselves (float8, complex, uint16, ...) travel as their bytes, and torch bfloat16
tensors as their 16-bit patterns.

torch tensors and numpy arrays are both accepted. This module never imports torch
itself: a torch tensor can only exist once the caller has imported torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..collectives import ProcessSet, broadcast_, broadcast_object, rank
from ..collectives.engine import COPY_DTYPES, end_of_sequence, is_torch_tensor
from ..collectives.errors import InvalidArgumentError, subject


def broadcast_parameters(params: Mapping[str, Any] | Iterable[Any], root_rank: int = 0,
                         process_set: ProcessSet | None = None) -> None:
    """Set every rank's parameters to ``root_rank``'s values, in place.

    Every rank must call it with the same parameters (names, shapes, dtypes), in the
    same order. A dict is taken in the order of its sorted names; pairs and lists in
    the order given.

    Args:
        params: a dict of name -> tensor (a torch ``state_dict()``, buffers included,
            or a dict of numpy arrays), an iterable of ``(name, tensor)`` pairs
            (``model.named_parameters()``), or a list or tuple of tensors, named
            ``"parameter 0"``, ``"parameter 1"``, ... Tensors are torch tensors (on the
            CPU or a GPU, any dtype) or numpy arrays.
        root_rank: world rank whose values every rank receives.
        process_set: the ranks taking part (default: all).

    Raises:
        InvalidArgumentError: ``params`` is not one of the forms above, or an entry is
            neither a torch tensor nor a numpy array of numbers (raised before any
            communication); or ``root_rank`` is not an int among the ranks.
        MismatchError: on every rank, when the ranks' parameters differ in names,
            number, shapes or dtypes; the message names the tensor.
    """
    named = _named(params)
    for name, value in named:
        if not _is_tensor(value):
            dtype = f" of dtype {value.dtype}" if isinstance(value, np.ndarray) else ""
            raise InvalidArgumentError(
                f"{subject('broadcast_parameters', name)}: holds a "
                f"{type(value).__name__}{dtype}; only torch tensors and numpy arrays "
                f"of numbers can be broadcast")
    for name, value in named:
        _broadcast_tensor(value, root_rank, name, process_set)
    # A rank with more tensors than another would wait for it forever (or meet its next
    # collective): a last call that every rank makes turns that into a MismatchError,
    # naming the extra tensor, on every rank.
    end_of_sequence("broadcast_parameters", process_set)


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0,
                              process_set: ProcessSet | None = None) -> None:
    """Make every rank's optimizer state equal to ``root_rank``'s, in place.

    The root's ``optimizer.state_dict()`` reaches every rank: its tensors (moments,
    step counts kept as tensors) one by one with ``broadcast_``, named by their path
    (``"state.3.exp_avg"``), everything else (learning rate, momentum, ``params``
    indices, step counts kept as numbers) pickled in one ``broadcast_object``. The other
    ranks then call ``optimizer.load_state_dict`` with it, so state that is empty
    (never stepped) on some or all ranks needs no step first. What ``load_state_dict``
    raises on a rank whose optimizer does not fit the root's state (torch: a
    ``ValueError`` when the parameter groups differ) reaches the caller on that rank,
    after all communication.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or any object with ``state_dict()`` and
            ``load_state_dict(state)`` whose state is nested dicts, lists and tuples of
            torch tensors, numpy arrays and picklable values. Other ranks receive torch
            tensors on the CPU (torch's ``load_state_dict`` moves them to the
            parameters' device) and dicts, lists and tuples of the built-in types.
        root_rank: world rank whose state every rank receives.
        process_set: the ranks taking part (default: all).

    Raises:
        InvalidArgumentError: ``root_rank`` is not an int among the ranks.
        MismatchError: on every rank, when the root's state cannot be pickled (the
            message gives pickle's error).
    """
    is_root = rank() == root_rank
    state = optimizer.state_dict() if is_root else None
    # The root sends its state with each tensor replaced by a spec: walking this
    # skeleton, every rank meets the tensors in the same order.
    skeleton = _map_tensors(state, lambda _, tensor: _TensorSpec.of(tensor))
    skeleton = broadcast_object(skeleton, root_rank, name="optimizer state",
                                process_set=process_set)

    def receive(path: str, leaf: Any) -> Any:
        tensor = leaf.empty() if isinstance(leaf, _TensorSpec) else leaf
        return _broadcast_tensor(tensor, root_rank, path, process_set)

    received = _map_tensors(state if is_root else skeleton, receive)
    if not is_root:
        optimizer.load_state_dict(received)


@dataclass(frozen=True)
class _TensorSpec:
    """Stands for a tensor in the pickled skeleton of a state dict.

    Attributes:
        kind: ``"torch"`` or ``"numpy"``.
        shape: the tensor's shape.
        dtype: torch's dtype name (``"bfloat16"``) or the numpy dtype.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: Any

    @classmethod
    def of(cls, tensor: Any) -> _TensorSpec:
        """The spec of a torch tensor or numpy array."""
        if isinstance(tensor, np.ndarray):
            return cls("numpy", tensor.shape, tensor.dtype)
        return cls("torch", tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))

    def empty(self) -> Any:
        """An uninitialized CPU tensor (or numpy array) of this shape and dtype."""
        if self.kind == "numpy":
            return np.empty(self.shape, self.dtype)
        import torch

        return torch.empty(self.shape, dtype=getattr(torch, self.dtype))


def _named(params: Mapping[str, Any] | Iterable[Any]) -> list[tuple[str, Any]]:
    """``params`` as ``(name, tensor)`` pairs: a dict's sorted by name."""
    if isinstance(params, Mapping):
        return sorted(((str(name), value) for name, value in params.items()),
                      key=lambda entry: entry[0])
    if not isinstance(params, Iterable) or isinstance(params, (str, bytes)):
        raise InvalidArgumentError(
            f"broadcast_parameters: params must be a dict of tensors, (name, tensor) "
            f"pairs or a list of tensors, got a {type(params).__name__}")
    return [item if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            else (f"parameter {index}", item)
            for index, item in enumerate(params)]


def _is_tensor(value: Any) -> bool:
    """A torch tensor, or a numpy array of numbers (an object array is a pickled value)."""
    if isinstance(value, np.ndarray):
        return not value.dtype.hasobject
    return is_torch_tensor(value)


def _map_tensors(tree: Any, function: Callable[[str, Any], Any], path: str = "") -> Any:
    """``tree`` (nested dicts, lists, tuples) rebuilt with ``function(path, leaf)`` for each
    tensor or spec leaf, in order; other values are kept. Paths join keys and indices
    with dots: ``"state.3.exp_avg"``."""
    if _is_tensor(tree) or isinstance(tree, _TensorSpec):
        return function(path, tree)
    prefix = f"{path}." if path else ""
    if isinstance(tree, Mapping):
        return {key: _map_tensors(value, function, f"{prefix}{key}")
                for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_map_tensors(item, function, f"{prefix}{index}")
                 for index, item in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _broadcast_tensor(tensor: Any, root_rank: int, name: str,
                      process_set: ProcessSet | None) -> Any:
    """Broadcast one torch tensor or numpy array in place; return it."""
    device_tensor = None
    array = tensor
    if is_torch_tensor(tensor):
        host = tensor.detach()
        if host.device.type != "cpu":
            # The collectives move host (numpy) arrays: a device tensor travels as a
            # contiguous CPU copy, copied back into it afterwards.
            device_tensor = host
            host = host.to("cpu", memory_format=sys.modules["torch"].contiguous_format)
        array = _numpy_view(host)
    contiguous = array if array.flags.c_contiguous else array.copy()
    broadcast_(_as_copyable(contiguous), root_rank, name=name, process_set=process_set)
    if contiguous is not array:
        array[...] = contiguous
    if device_tensor is not None:
        device_tensor.copy_(host)
    return tensor


def _numpy_view(tensor: Any) -> np.ndarray:
    """A numpy array sharing a CPU tensor's memory. A dtype that numpy lacks (bfloat16,
    float8, complex32) is viewed as the signed integer of its width: only bits travel."""
    try:
        return tensor.numpy()
    except TypeError:  # "Got unsupported ScalarType BFloat16"
        torch = sys.modules["torch"]
        return tensor.view(getattr(torch, f"int{8 * tensor.element_size()}")).numpy()


def _as_copyable(array: np.ndarray) -> np.ndarray:
    """A C-contiguous ``array`` itself when the collectives move its dtype, else a view of
    its bytes (one more axis, of the item size)."""
    if array.dtype in COPY_DTYPES:
        return array
    return array.reshape(*array.shape, 1).view(np.uint8)


__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]
