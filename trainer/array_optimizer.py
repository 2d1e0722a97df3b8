"""DistributedOptimizer for plain numpy training loops.

The protocol, for an optimizer that is not a ``torch.optim.Optimizer``:

- the model's gradients live in arrays that the training code writes in place each
  step (``grad[...] = ...`` or ``np.matmul(..., out=grad)``), and are handed to the
  wrapper once as ``named_parameters``: ``(name, parameter, gradient)`` triples, in the
  model's order (first layer first);
- the wrapped optimizer has ``step()``, which reads the gradient arrays and updates
  the parameter arrays; ``zero_grad()``, ``state_dict()`` and ``load_state_dict()``
  are used when it has them.

A training step is then::

    loss = forward_and_backward(batch)      # writes the gradient arrays
    optimizer.step()                        # averages them across ranks, then steps

To overlap communication with the backward pass, call ``optimizer.mark_ready(name)``
as soon as each gradient is final (last layer first): its bucket's allreduce starts
then, on ringtrain's collectives thread, while the rest of the backward pass runs.
Gradients not marked are reduced when ``step()`` (or ``synchronize()``) is called.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..collectives import Average, Compression, Compressor, ProcessSet, ReduceOp
from ..collectives.errors import InvalidArgumentError, UsageError
from ..kernels import twin_for
from ._names import repeated_names
from ._synchronized import SynchronizedSteps
from .balance import LoadBalancer
from .gradient_reducer import GradientReducer, predivide_factors


class ArrayDistributedOptimizer(SynchronizedSteps):
    """Wraps an optimizer over numpy arrays so that ``step()`` uses averaged gradients.

    Args:
        optimizer: any object with ``step()`` that updates the parameters from the
            gradient arrays.
        named_parameters: ``(name, parameter, gradient)`` triples, in the model's
            order; names unique and the same on every rank, each gradient a writable
            array of its parameter's shape.
        compression, backward_passes_per_step, op, gradient_predivide_factor,
            process_set, fusion_threshold, first_bucket_bytes, balance: as for the
            PyTorch :class:`~ringtrain.trainer.torch_optimizer.DistributedOptimizer`.

    Raises:
        InvalidArgumentError: a missing ``step()``, a malformed triple, a gradient of
            the wrong shape, a read-only gradient, duplicate names.
    """

    def __init__(self, optimizer: Any, named_parameters: Iterable[tuple[str, Any, Any]],
                 compression: Compressor = Compression.none,
                 backward_passes_per_step: int = 1, op: ReduceOp = Average,
                 gradient_predivide_factor: float = 1.0,
                 process_set: ProcessSet | None = None, *,
                 fusion_threshold: int | None = None,
                 first_bucket_bytes: int = 1 << 20, balance: LoadBalancer | None = None):
        if not callable(getattr(optimizer, "step", None)):
            raise InvalidArgumentError(
                f"optimizer must have a step() method, got {type(optimizer).__name__}")
        if named_parameters is None:
            raise InvalidArgumentError(
                "named_parameters is required for an optimizer over arrays: "
                "(name, parameter, gradient) triples in the model's order")
        self.optimizer = optimizer
        self._gradients = _checked_triples(named_parameters)
        prescale, postscale = predivide_factors(op, gradient_predivide_factor)
        self._reducer = GradientReducer(
            list(self._gradients.items()), op=op, compression=compression,
            prescale_factor=prescale, postscale_factor=postscale, process_set=process_set,
            fusion_threshold=fusion_threshold, first_bucket_bytes=first_bucket_bytes,
            backward_passes_per_step=backward_passes_per_step)
        self._attach_balance(balance, op, process_set, "DistributedOptimizer")
        self._arrays = list(self._gradients.values())

    def gradient_arrays(self) -> list[np.ndarray]:
        """The gradient arrays, in order."""
        return list(self._arrays)

    def mark_ready(self, name: str) -> None:
        """Say that gradient ``name`` is final for this backward pass.

        Raises:
            InvalidArgumentError: no gradient has that name.
            UsageError: marked more often than ``backward_passes_per_step`` in a step.
        """
        index = self._reducer.index_of(name)
        self._reducer.mark_ready(index, self._arrays[index])

    def set_gradient_masks(self, masks: Mapping[str, np.ndarray | None]) -> None:
        """Send only the gradients' kept elements (mask nonzero) from the next step on;
        gradients not named travel whole. Every rank must give the same masks (see
        :meth:`GradientReducer.set_masks`).

        Raises:
            InvalidArgumentError: an unknown name, a mask of another shape.
            UsageError: called while gradients are being reduced.
        """
        arrays: list[np.ndarray | None] = [None] * len(self._arrays)
        for name, mask in masks.items():
            arrays[self._reducer.index_of(name)] = mask
        self._reducer.set_masks(arrays)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Synchronize (unless inside :meth:`skip_synchronize`), then call the wrapped
        optimizer's ``step(*args, **kwargs)`` and return what it returns."""
        self._synchronize_for_step()
        result = self.optimizer.step(*args, **kwargs)
        self._balance.stepped()
        return result

    def zero_grad(self) -> None:
        """The wrapped optimizer's ``zero_grad()`` if it has one, else zero every gradient.

        Raises:
            UsageError: called while gradients marked ready are being reduced.
        """
        if self._reducer.in_progress():
            raise UsageError(
                "optimizer.zero_grad() was called after gradients were marked ready and "
                "before optimizer.step() or optimizer.synchronize(): they are being "
                "reduced in place")
        zero_grad = getattr(self.optimizer, "zero_grad", None)
        if callable(zero_grad):
            zero_grad()
        else:
            for gradient in self._arrays:
                gradient[...] = 0
        self._balance.compute_started()

    def state_dict(self) -> Any:
        """The wrapped optimizer's ``state_dict()``."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        """The wrapped optimizer's ``load_state_dict()``."""
        self.optimizer.load_state_dict(state_dict)

    def _missing(self, index: int) -> np.ndarray:
        return self._arrays[index]

    def __repr__(self) -> str:
        return f"ArrayDistributedOptimizer({self.optimizer!r}, {self._reducer!r})"


def _checked_triples(named_parameters: Iterable[tuple[str, Any, Any]]) -> dict[str, np.ndarray]:
    """Gradient arrays by name, in order, after checking each triple."""
    gradients: dict[str, np.ndarray] = {}
    names: list[str] = []
    for position, entry in enumerate(named_parameters):
        try:
            name, parameter, gradient = entry
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"named_parameters[{position}]: expected a (name, parameter, gradient) "
                f"triple, got {type(entry).__name__}") from None
        try:
            twin_for(gradient)
        except TypeError:
            raise InvalidArgumentError(
                f"gradient of {name!r}: expected a numpy array or a device array, got "
                f"{type(gradient).__name__}") from None
        if tuple(gradient.shape) != tuple(parameter.shape):
            raise InvalidArgumentError(
                f"gradient of {name!r} has shape {tuple(gradient.shape)}, its parameter "
                f"{tuple(parameter.shape)}")
        if isinstance(gradient, np.ndarray) and not gradient.flags.writeable:
            raise InvalidArgumentError(f"gradient of {name!r} is read-only")
        names.append(name)
        gradients[name] = gradient
    repeated = repeated_names(names)
    if repeated:
        raise InvalidArgumentError(
            f"named_parameters repeats the name(s) {', '.join(map(repr, repeated))}; "
            f"every parameter needs a name of its own")
    return gradients
