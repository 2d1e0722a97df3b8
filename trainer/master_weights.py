"""fp32 master weights for float16 and bfloat16 models (mixed precision).

With ``DistributedOptimizer(..., master_weights=True)`` the wrapped optimizer steps a
float32 copy of each float16 or bfloat16 parameter instead of the parameter itself: its
``param_groups`` hold the copies in the parameters' places (the groups and their
hyper-parameters are the user's, so learning-rate schedulers work as before), and its
state (momentum, Adam's moments) is float32 as well. Each step:

1. the gradients are reduced in the parameters' own dtype (16 bits on the wire);
2. :meth:`MasterWeights.upcast_gradients` writes each averaged gradient into its copy's
   ``.grad``, in float32 (``synchronize()`` does this, so clipping after it sees them);
3. the wrapped optimizer steps the copies;
4. :meth:`MasterWeights.end_step` rounds the copies into the model's parameters.

The copies are taken from the model's parameters when first needed (the first step, or
``state_dict()``), so weights set after wrapping (``broadcast_parameters``, a checkpoint
loaded into the model) are kept. From then on the copies are the weights and the model
holds their rounded values; the copies travel in the optimizer's ``state_dict()`` under
:data:`STATE_KEY`, so a restart resumes from them, not from the rounded values.

Parameters of other dtypes (float32, float64) are stepped as they are.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..collectives.errors import InvalidArgumentError, subject

LOW_PRECISION = (torch.float16, torch.bfloat16)
"""The parameter dtypes that get a float32 copy."""

STATE_KEY = "master_weights"
"""The key of the copies in the optimizer's ``state_dict()``: ``{position: tensor}``, the
position being the parameter's in the optimizer's ``param_groups`` (torch's numbering of
``state``)."""

_GRADIENTS_CHANGED = (
    "the gradients of {names} changed after optimizer.synchronize(): with "
    "master_weights=True the optimizer steps float32 copies, whose gradients synchronize() "
    "filled; the changed 16-bit gradients are used (upcast again). Clip "
    "optimizer.master_parameters() instead, to clip in float32")


@dataclasses.dataclass
class _Copy:
    """One low-precision parameter and its float32 copy.

    Attributes:
        index: the parameter's index among the optimizer's trainable parameters.
        name: its name.
        parameter: the model's parameter (float16 or bfloat16).
        master: the float32 copy the optimizer steps.
        position: the copy's position in the optimizer's ``param_groups``.
    """

    index: int
    name: str
    parameter: torch.Tensor
    master: torch.Tensor
    position: int


class MasterWeights:
    """The float32 copies of an optimizer's float16 and bfloat16 parameters.

    Building it puts the copies in ``optimizer.param_groups`` in the parameters' places
    and moves any state the optimizer already holds for them to the copies (floating
    tensors cast to float32, as torch's ``load_state_dict`` casts state to its
    parameter's dtype).

    Args:
        optimizer: the optimizer to step the copies.
        parameters: ``(name, parameter)`` of the optimizer's trainable parameters; the
            position in this list is a parameter's index.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 parameters: Sequence[tuple[str, torch.Tensor]]):
        self.optimizer = optimizer
        copies: dict[int, tuple[int, str, torch.Tensor, torch.Tensor]] = {}
        for index, (name, parameter) in enumerate(parameters):
            if parameter.dtype in LOW_PRECISION:
                with torch.no_grad():
                    master = torch.empty_like(parameter, dtype=torch.float32).copy_(parameter)
                master.requires_grad_(parameter.requires_grad)
                copies[id(parameter)] = (index, name, parameter, master)
        for group in optimizer.param_groups:
            group["params"][:] = [copies[id(p)][3] if id(p) in copies else p
                                  for p in group["params"]]
        positions = {id(p): position for position, p in
                     enumerate(p for group in optimizer.param_groups for p in group["params"])}
        self._copies = [_Copy(index, name, parameter, master, positions[id(master)])
                        for index, name, parameter, master in copies.values()]
        self._by_index = {entry.index: entry for entry in self._copies}
        for entry in self._copies:
            saved = optimizer.state.pop(entry.parameter, None)
            if saved:
                optimizer.state[entry.master] = {key: _as_master_state(key, value)
                                                for key, value in saved.items()}
        self._taken = False
        self._upcast_from: list[tuple[torch.Tensor | None, int]] | None = None

    def __len__(self) -> int:
        return len(self._copies)

    def master_of(self, index: int) -> torch.Tensor | None:
        """The float32 copy of parameter ``index``, or None when it has none."""
        entry = self._by_index.get(index)
        return None if entry is None else entry.master

    def take_from_model(self) -> None:
        """Set the copies to the model's parameters, unless already done (or loaded)."""
        if self._taken:
            return
        with torch.no_grad():
            for entry in self._copies:
                entry.master.copy_(entry.parameter)
        self._taken = True

    def upcast_gradients(self) -> None:
        """Write each parameter's gradient into its copy's ``.grad``, as float32 (a
        parameter without a gradient leaves its copy without one, and the optimizer
        skips it)."""
        upcast_from = []
        with torch.no_grad():
            for entry in self._copies:
                gradient = entry.parameter.grad
                upcast_from.append((gradient, -1 if gradient is None else gradient._version))
                master = entry.master
                if gradient is None:
                    master.grad = None
                elif master.grad is None or master.grad.shape != gradient.shape:
                    master.grad = gradient.detach().to(torch.float32)
                else:
                    master.grad.copy_(gradient)
        self._upcast_from = upcast_from

    def gradients_for_step(self) -> None:
        """Upcast the gradients for the optimizer's step, unless they were upcast (by
        ``synchronize()``) and have not changed since; a change (the 16-bit gradients
        clipped after ``synchronize()``) is used, with a warning."""
        if self._upcast_from is None:
            self.upcast_gradients()
            return
        changed = [entry.name for entry, (gradient, version) in
                   zip(self._copies, self._upcast_from)
                   if entry.parameter.grad is not gradient or
                   (gradient is not None and gradient._version != version)]
        if changed:
            shown = ", ".join(map(repr, changed[:3])) + (", ..." if len(changed) > 3 else "")
            warnings.warn(_GRADIENTS_CHANGED.format(names=shown), UserWarning, stacklevel=3)
            self.upcast_gradients()

    def copy_to_model(self) -> None:
        """Round the copies into the model's parameters."""
        with torch.no_grad():
            for entry in self._copies:
                entry.parameter.copy_(entry.master)

    def end_step(self) -> None:
        """After the optimizer stepped the copies: round them into the model's parameters;
        the next step upcasts its gradients afresh."""
        self.copy_to_model()
        self._upcast_from = None

    def zero_model_gradients(self, set_to_none: bool) -> None:
        """Zero (or drop) the gradients of the model's low-precision parameters, which the
        wrapped optimizer no longer holds."""
        with torch.no_grad():
            for entry in self._copies:
                if set_to_none:
                    entry.parameter.grad = None
                elif entry.parameter.grad is not None:
                    entry.parameter.grad.zero_()
        self._upcast_from = None

    def state_dict(self) -> dict[int, torch.Tensor]:
        """The copies by position in ``param_groups``: detached views of the live tensors,
        as torch's own ``state_dict()`` holds the live state (deep-copy to keep a
        snapshot)."""
        self.take_from_model()
        return {entry.position: entry.master.detach() for entry in self._copies}

    def check(self, saved: Mapping[Any, Any] | None) -> None:
        """Raise unless :meth:`load_state_dict` can load ``saved`` (None always can).

        Raises:
            InvalidArgumentError: positions or shapes that are not this optimizer's.
        """
        if saved is None:
            return
        if not isinstance(saved, Mapping):
            raise InvalidArgumentError(
                f"{subject('load_state_dict', STATE_KEY)}: expected a dict of tensors by "
                f"parameter position, got a {type(saved).__name__}")
        positions = {int(position) for position in saved}
        mine = {entry.position: entry for entry in self._copies}
        if positions != set(mine):
            raise InvalidArgumentError(
                f"{subject('load_state_dict', STATE_KEY)}: the state holds float32 copies "
                f"of the parameters at positions {sorted(positions)}, this optimizer has "
                f"float16/bfloat16 parameters at {sorted(mine)}; load a state_dict saved "
                f"by an optimizer over the same model with master_weights=True")
        for position, value in saved.items():
            entry = mine[int(position)]
            shape = tuple(getattr(value, "shape", ()))
            if not isinstance(value, torch.Tensor) or shape != tuple(entry.master.shape):
                raise InvalidArgumentError(
                    f"{subject('load_state_dict', entry.name)}: its float32 copy in the "
                    f"state is a {type(value).__name__} of shape {shape}, the parameter "
                    f"has shape {tuple(entry.master.shape)}")

    def load_state_dict(self, saved: Mapping[Any, Any] | None) -> None:
        """Set the copies to ``saved`` (a :meth:`state_dict`) and round them into the
        model. None (a state saved without master weights) takes the copies from the
        model's parameters again at their next use.

        Raises:
            InvalidArgumentError: as :meth:`check`.
        """
        self.check(saved)
        if saved is None:
            self._taken = False
            return
        by_position = {int(position): value for position, value in saved.items()}
        with torch.no_grad():
            for entry in self._copies:
                entry.master.copy_(by_position[entry.position])
        self._taken = True
        self.copy_to_model()

    def __repr__(self) -> str:
        return f"MasterWeights({len(self._copies)} float32 copies)"


def _as_master_state(key: str, value: Any) -> Any:
    """Optimizer state moved to a float32 copy: floating tensors (other than step counts)
    in float32."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
        return value.to(torch.float32)
    return value
