"""The call forms of a collective, declared once (:class:`CallForms`): the blocking call
and the asynchronous one, out of place and in place, with the fast path that runs a
call made before by its kept plan.

A collective module declares its forms with the functions that are its own: how a call
is validated and turned into its body (``prepare``), where a call made before finds its
plan (``kept``), and how a kept plan runs (``planned``; ``carried`` where the data rides
in the agreement). Its public functions state their signature and documentation and
hand their arguments to :meth:`CallForms.blocking` or :meth:`CallForms.start`:
everything else a call does (the fast path, the refusal a rank shares with the others,
the program order, the result handed back as the caller's kind of tensor) is written
here once. The arguments that are the collective's own (an allreduce's op, a
broadcast's root) travel as one tuple, in the order of the public signature: the fast
path then passes them on without packing them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..base._buffers import results_like, returns_itself
from ..base._executor import Handle
from ..world._process_sets import ProcessSet
from ._calls import collective_call, run_validated

Prepare = Callable[..., Callable[[], Any]]
"""``prepare(collective, tensor, name, process_set, *arguments)``: validate a call
(``collective`` ends in ``_`` in place) and return its body."""
Kept = Callable[[str, np.ndarray, "str | None", "ProcessSet | None", tuple], Any]
"""``kept(collective, tensor, name, process_set, arguments)``: the plan kept for a call
like this one on numpy array ``tensor``, or None (the general path)."""
Run = Callable[[Any, str, "str | None", np.ndarray, "np.ndarray | None", tuple], Any]
"""``run(plan, collective, name, tensor, output, arguments)``: a kept plan's run on
C-contiguous ``tensor`` into ``output`` (``tensor`` in place; None where the run makes
the result and returns it)."""
NewArray = Callable[[tuple[int, ...], np.dtype], np.ndarray]


class CallForms:
    """The forms of one collective, declared once.

    Args:
        collective: the collective's name (``allreduce``); its in-place forms are
            named with a trailing ``_``.
        prepare: validates a call and returns its body (see :data:`Prepare`).
        kept: finds the plan of a call made before (see :data:`Kept`); None where the
            collective has no fast path.
        planned: the run of a kept plan (see :data:`Run`); None where only plans
            whose data rides in the agreement run fast.
        carried: the run of a kept plan whose data rides in the agreement.
        planned_output, carried_output: make the result of ``planned`` and ``carried``
            out of place (``np.empty``, ``RESULTS.empty``); None where the run makes it.
    """

    __slots__ = ("collective", "_names", "_prepare", "_kept", "_planned", "_carried",
                 "_planned_output", "_carried_output")

    def __init__(self, collective: str, prepare: Prepare, kept: Kept | None = None,
                 planned: Run | None = None, carried: Run | None = None,
                 planned_output: NewArray | None = None,
                 carried_output: NewArray | None = None):
        self.collective = collective
        self._names = (collective, collective + "_")
        self._prepare, self._kept = prepare, kept
        self._planned, self._carried = planned, carried
        self._planned_output, self._carried_output = planned_output, carried_output

    def blocking(self, in_place: bool, tensor: Any, name: str | None,
                 process_set: ProcessSet | None, arguments: tuple) -> Any:
        """Make the call and return its result: ``tensor`` itself in place (the
        caller's object, reduced), else a new tensor of the caller's kind.

        A call on a numpy array like one made before takes the fast path: it runs by
        the plan kept for it, through :func:`run_validated`, unless the array is not
        C-contiguous (in place: or not writeable) or no run applies to the plan."""
        collective = self._names[in_place]
        if self._kept is not None and type(tensor) is np.ndarray:
            plan = self._kept(collective, tensor, name, process_set, arguments)
            if plan is not None:
                flags = tensor.flags
                if plan.carried is not None:
                    run, new = self._carried, self._carried_output
                else:
                    run, new = self._planned, self._planned_output
                if run is not None and flags.c_contiguous and \
                        (not in_place or flags.writeable):
                    output = tensor if in_place else \
                        None if new is None else new(tensor.shape, tensor.dtype)
                    result = run_validated(collective, name, process_set, run, plan,
                                           collective, name, tensor, output, arguments)
                    return result if output is None else output
        return self._validated(collective, in_place, tensor, name, process_set, arguments,
                               False)

    def start(self, in_place: bool, tensor: Any, name: str | None,
              process_set: ProcessSet | None, arguments: tuple) -> Handle:
        """Start the call on the collectives' thread; ``synchronize(handle)`` returns
        what :meth:`blocking` returns."""
        return self._validated(self._names[in_place], in_place, tensor, name, process_set,
                               arguments, True)

    def _validated(self, collective: str, in_place: bool, tensor: Any, name: str | None,
                   process_set: ProcessSet | None, arguments: tuple,
                   asynchronous: bool) -> Any:
        """The general path: the call validated by ``prepare``, then run (see
        :func:`collective_call`)."""
        return collective_call(
            collective, name, process_set,
            lambda: self._prepare(collective, tensor, name, process_set, *arguments),
            asynchronous=asynchronous,
            restore=returns_itself(tensor) if in_place else results_like(tensor))
