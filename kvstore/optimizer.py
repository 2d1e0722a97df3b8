"""Optimizers that run where a store's keys live (MXNet's ``update_on_kvstore``).

An optimizer is any object with MXNet's two methods:

- ``create_state(index, weight)``: the state of key ``index`` (anything picklable, or
  None), made before its first update;
- ``update(index, weight, grad, state)``: update ``weight`` in place from ``grad``.

``weight`` and ``grad`` are host numpy arrays of the key's shape and dtype (the part of
a large key held by one server, in the async modes: updates must be elementwise).
:class:`SGD` and :class:`Adam` take MXNet's parameter names; :class:`TorchOptimizer`
runs a ``torch.optim`` class on each key, :class:`Updater` a plain function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives import InvalidArgumentError


class Optimizer:
    """Base class: MXNet's common parameters.

    Args:
        learning_rate: the step size.
        wd: weight decay (L2), added to the gradient as ``wd * weight``.
        rescale_grad: multiplies every gradient first (e.g. 1 / batch size).
        clip_gradient: clip the rescaled gradient to ``[-clip_gradient, clip_gradient]``;
            None: no clipping.
    """

    def __init__(self, learning_rate: float = 0.01, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None):
        if clip_gradient is not None and clip_gradient <= 0:
            raise InvalidArgumentError(f"clip_gradient must be > 0 or None, got {clip_gradient}")
        self.learning_rate = learning_rate
        self.wd = wd
        self.rescale_grad = rescale_grad
        self.clip_gradient = clip_gradient

    def create_state(self, index: Any, weight: np.ndarray) -> Any:
        """No state."""
        return None

    def update(self, index: Any, weight: np.ndarray, grad: np.ndarray, state: Any) -> None:
        """Update ``weight`` in place; subclasses define it."""
        raise NotImplementedError

    def _gradient(self, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """``clip(rescale_grad * grad) + wd * weight``, in the weight's dtype (new array)."""
        g = grad.astype(weight.dtype, copy=True)
        if self.rescale_grad != 1.0:
            g *= weight.dtype.type(self.rescale_grad)
        if self.clip_gradient is not None:
            np.clip(g, -self.clip_gradient, self.clip_gradient, out=g)
        if self.wd:
            g += weight.dtype.type(self.wd) * weight
        return g

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class SGD(Optimizer):
    """MXNet's SGD: ``mom = momentum * mom - lr * g; weight += mom`` (``weight -= lr * g``
    without momentum), ``g`` being :meth:`Optimizer._gradient`.

    Args:
        learning_rate, wd, rescale_grad, clip_gradient: see :class:`Optimizer`.
        momentum: 0 keeps no state.
    """

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient)
        self.momentum = momentum

    def create_state(self, index: Any, weight: np.ndarray) -> np.ndarray | None:
        """The momentum buffer (zeros), or None without momentum."""
        return np.zeros_like(weight) if self.momentum else None

    def update(self, index: Any, weight: np.ndarray, grad: np.ndarray,
               state: np.ndarray | None) -> None:
        """One SGD step on ``weight`` in place."""
        g = self._gradient(weight, grad)
        lr = weight.dtype.type(self.learning_rate)
        if state is None:
            weight -= lr * g
            return
        state *= weight.dtype.type(self.momentum)
        state -= lr * g
        weight += state


class Adam(Optimizer):
    """MXNet's Adam: with ``t`` the key's update count,
    ``lr_t = learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t)``,
    ``mean = beta1 * mean + (1 - beta1) * g``, ``var = beta2 * var + (1 - beta2) * g**2``,
    ``weight -= lr_t * mean / (sqrt(var) + epsilon)``.

    Args:
        learning_rate, wd, rescale_grad, clip_gradient: see :class:`Optimizer`.
        beta1, beta2: decay of the first and second moment.
        epsilon: added to the denominator.
    """

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def create_state(self, index: Any, weight: np.ndarray) -> dict[str, Any]:
        """``{'t': 0, 'mean': zeros, 'var': zeros}``."""
        return {"t": 0, "mean": np.zeros_like(weight), "var": np.zeros_like(weight)}

    def update(self, index: Any, weight: np.ndarray, grad: np.ndarray,
               state: dict[str, Any]) -> None:
        """One Adam step on ``weight`` in place."""
        g = self._gradient(weight, grad)
        state["t"] += 1
        t = state["t"]
        lr = self.learning_rate * math.sqrt(1 - self.beta2 ** t) / (1 - self.beta1 ** t)
        mean, var, dtype = state["mean"], state["var"], weight.dtype.type
        mean *= dtype(self.beta1)
        mean += dtype(1 - self.beta1) * g
        var *= dtype(self.beta2)
        var += dtype(1 - self.beta2) * g * g
        weight -= dtype(lr) * mean / (np.sqrt(var) + dtype(self.epsilon))


class TorchOptimizer:
    """A ``torch.optim`` class run on each key, as an optimizer of the store.

    Each key gets its own instance over a tensor that shares the weight's memory, so
    the torch optimizer updates the store's weight in place; its state is that instance.

    Args:
        optimizer_class: e.g. ``torch.optim.AdamW``.
        **hyperparameters: passed to it (``lr=...``).
    """

    def __init__(self, optimizer_class: type, **hyperparameters: Any):
        self.optimizer_class = optimizer_class
        self.hyperparameters = hyperparameters

    def create_state(self, index: Any, weight: np.ndarray) -> Any:
        """A new torch optimizer over a tensor sharing ``weight``'s memory."""
        import torch
        parameter = torch.nn.Parameter(torch.from_numpy(weight))
        return self.optimizer_class([parameter], **self.hyperparameters)

    def update(self, index: Any, weight: np.ndarray, grad: np.ndarray, state: Any) -> None:
        """``state.step()`` with ``grad`` as the gradient of the weight."""
        import torch
        parameter = state.param_groups[0]["params"][0]
        # A state loaded from a file holds a copy: point it at the store's weight again.
        parameter.data = torch.from_numpy(weight)
        parameter.grad = torch.from_numpy(np.ascontiguousarray(grad, dtype=weight.dtype))
        state.step()

    def __repr__(self) -> str:
        return f"TorchOptimizer({self.optimizer_class.__name__}, {self.hyperparameters!r})"


class Updater:
    """A plain function as an optimizer: MXNet's updater ``updater(key, grad, weight)``,
    which changes ``weight`` in place (e.g. ``weight += grad`` to accumulate).

    Args:
        function: called as ``function(key, grad, weight)``; no state.
    """

    def __init__(self, function: Callable[[Any, np.ndarray, np.ndarray], None]):
        self.function = function

    def create_state(self, index: Any, weight: np.ndarray) -> None:
        """No state."""
        return None

    def update(self, index: Any, weight: np.ndarray, grad: np.ndarray, state: Any) -> None:
        """``function(index, grad, weight)``."""
        self.function(index, grad, weight)

    def __repr__(self) -> str:
        return f"Updater({getattr(self.function, '__name__', self.function)!r})"


def as_optimizer(optimizer: Any) -> Any:
    """``optimizer`` as the store runs it: an object with ``update`` and ``create_state``
    as it is, a torch optimizer class as :class:`TorchOptimizer` with its defaults, any
    other callable as :class:`Updater`.

    Raises:
        InvalidArgumentError: none of these.
    """
    if callable(getattr(optimizer, "update", None)) and \
            callable(getattr(optimizer, "create_state", None)):
        return optimizer
    torch_optim = _torch_optimizer_base()
    if isinstance(optimizer, type) and torch_optim is not None and \
            issubclass(optimizer, torch_optim):
        return TorchOptimizer(optimizer)
    if callable(optimizer):
        return Updater(optimizer)
    raise InvalidArgumentError(f"kvstore set_optimizer: expected an object with update(index, "
                               f"weight, grad, state) and create_state(index, weight), a "
                               f"torch optimizer class or a function, got "
                               f"{type(optimizer).__name__}")


def _torch_optimizer_base() -> type | None:
    import sys
    torch = sys.modules.get("torch")
    return None if torch is None else torch.optim.Optimizer


__all__ = ["Optimizer", "SGD", "Adam", "TorchOptimizer", "Updater", "as_optimizer"]
