"""The framework-neutral gradient reducer: fusion buckets allreduced while backward runs.

Built once from the gradients' names, shapes and dtypes. Every step, the training code
(or a framework hook) calls :meth:`GradientReducer.mark_ready` as each gradient is
final; the bucket holding it starts its allreduce as soon as all its gradients are
ready and every bucket before it has started, so every rank launches the buckets in the
same order whatever order its gradients arrive in. The allreduces run on ringtrain's
single collectives thread (the only thread that enters MPI), so the training thread
never waits for the network until :meth:`GradientReducer.wait`.

One bucket's allreduce, on the collectives thread: pack its gradients into the bucket's
buffer with the prescale fused into the copy (one kernel launch), agree with the other
ranks, reduce (encoding to fp16/bf16 and back when compressing, with the 1/N and the
postscale fused into the decode), unpack into the gradients. A bucket of one
contiguous gradient skips the copies and is reduced in place.

Pruning-aware buckets: given masks (:meth:`GradientReducer.set_masks`), a bucket carries
only the kept elements of its masked gradients (see :mod:`._gradient_masks`), and the
buckets are assigned again from the gradients' kept sizes, alike on every rank (the
masks are the same everywhere), so the bytes sent per step fall with the sparsity.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..collectives import Average, Compression, Compressor, ProcessSet, ReduceOp
from ..collectives.engine import (AllreducePlan, Handle, allreduce_plan, device_tensor,
                                  on_device, reduce_fused, reduce_planned, submit)
from ..collectives.errors import InvalidArgumentError, UsageError
from ..kernels import FusionLayout, host, twin_for
from ..kernels.dispatch import dtype_of
from ..kernels.layout import DEFAULT_ALIGNMENT_BYTES
from ._buckets import DEFAULT_FIRST_BUCKET_BYTES, GradientSpec, assign_buckets
from ._buckets import fusion_threshold as resolve_fusion_threshold
from ._gradient_masks import (KeptElements, gather_kept, kept_elements, kept_name,
                              scatter_kept)
from ._names import repeated_names

_COLLECTIVE = "allreduce_"
_NAMES_SHOWN = 3


class Bucket:
    """Gradients reduced as one message: their indices, layout, buffer and name.

    Attributes:
        index: position in launch order.
        members: indices of the gradients, in buffer order.
        name: names the bucket in errors (the same on every rank for the same model).
        kept: for a pruning-aware bucket, each member's kept elements (None: all of
            them); None for a dense bucket.
    """

    def __init__(self, index: int, count: int, members: list[int],
                 specs: Sequence[GradientSpec],
                 kept: Sequence[KeptElements | None] | None = None):
        self.index = index
        self.members = members
        names = [specs[i].name for i in members]
        shown = ", ".join(names[:_NAMES_SHOWN])
        more = f", +{len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
        self.name = f"gradient bucket {index + 1}/{count} [{shown}{more}]"
        dtype = specs[members[0]].dtype
        masked = [kept[i] for i in members] if kept is not None else []
        self.kept = masked if any(k is not None for k in masked) else None
        if self.kept is not None:
            # Kept elements one gradient after the other: the bytes sent are theirs alone.
            sizes = [specs[i].nbytes // dtype.itemsize if k is None else k.count
                     for i, k in zip(members, self.kept)]
            self.name = kept_name(self.name, [None if k is None else k.kept
                                              for k in self.kept])
            self.layout = FusionLayout([(n,) for n in sizes], dtype, dtype.itemsize)
        else:
            # A gradient alone is reduced where it lies when it is contiguous, so its
            # bucket's buffer (used otherwise) must have no padding either.
            alignment = dtype.itemsize if len(members) == 1 else DEFAULT_ALIGNMENT_BYTES
            self.layout = FusionLayout([specs[i].shape for i in members], dtype, alignment)
        self.buffer: np.ndarray | None = None
        self.device_buffer: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes of the bucket's gradients, padding included."""
        return self.layout.nbytes

    def reduce(self, plan: AllreducePlan, device_plan: Callable[[], AllreducePlan],
               gradients: list[Any], prescale_factor: float, postscale_factor: float,
               as_array: Callable[[Any], Any] | None) -> None:
        """Allreduce ``gradients`` in place (runs on the collectives thread): host arrays
        as ``plan`` says, device arrays as ``device_plan()`` says (GPU casts, copies
        through pinned host memory pipelined with the reduction, or device memory handed
        to a CUDA-aware MPI), packed into the bucket's buffer and unpacked on their side."""
        if as_array is not None:
            gradients = [as_array(g) for g in gradients]
        described = device_tensor(gradients[0], _COLLECTIVE, self.name)
        if self.kept is not None:
            self._reduce_kept(plan, gradients, prescale_factor, postscale_factor,
                              described is not None)
            return
        if described is None:
            if len(gradients) == 1 and gradients[0].flags.c_contiguous:
                flat = gradients[0].reshape(-1)
                reduce_planned(plan, _COLLECTIVE, self.name, flat, flat, prescale_factor,
                               postscale_factor)
                return
            if self.buffer is None:
                self.buffer = self.layout.empty_buffer()
            reduce_fused(plan, _COLLECTIVE, self.name, self.layout, gradients, self.buffer,
                         prescale_factor, postscale_factor)
            return
        with on_device(described):
            if self.device_buffer is None:
                self.device_buffer = twin_for(gradients[0]).empty(
                    (self.layout.total_size,), self.layout.dtype)
            reduce_fused(device_plan(), _COLLECTIVE, self.name, self.layout, gradients,
                         self.device_buffer, prescale_factor, postscale_factor,
                         described.device)

    def _reduce_kept(self, plan: AllreducePlan, gradients: list[Any], prescale_factor: float,
                     postscale_factor: float, on_device: bool) -> None:
        """Gather the kept elements into the buffer, allreduce it, scatter them back."""
        if on_device:
            # Refused alike on every rank (masks and devices are the same everywhere), so
            # no rank waits for this bucket's message.
            raise UsageError(f"{self.name}: pruning-aware buckets reduce host gradients; "
                             f"these are in device memory")
        if self.buffer is None:
            self.buffer = self.layout.empty_buffer()
        views = self.layout.views(self.buffer)
        for gradient, kept, view in zip(gradients, self.kept, views):
            gather_kept(gradient, kept, view)
        flat = self.buffer.reshape(-1)
        reduce_planned(plan, _COLLECTIVE, self.name, flat, flat, prescale_factor,
                       postscale_factor)
        for gradient, kept, view in zip(gradients, self.kept, views):
            scatter_kept(view, kept, gradient)


class GradientReducer:
    """Averages (or otherwise reduces) a model's gradients across ranks, bucket by bucket.

    Args:
        gradients: for each gradient, in parameter registration order, its name and an
            array-like with its shape and dtype (the parameter itself will do). Names
            must be unique and the same on every rank.
        op: the reduction (Average by default; Sum, Min, Max, Product; not Adasum).
        compression: ``Compression.none`` (default), ``Compression.fp16`` or
            ``Compression.bf16`` (float32 gradients travel as 16-bit floats).
        prescale_factor: multiplies each gradient before the reduction.
        postscale_factor: multiplies each result.
        process_set: the ranks that share the model (default: all).
        fusion_threshold: bucket size limit in bytes; 0 gives every gradient its own
            allreduce. Default: ``RINGTRAIN_FUSION_THRESHOLD`` or 8 MiB.
        first_bucket_bytes: the first bucket's limit (default 1 MiB).
        backward_passes_per_step: a gradient is ready after this many
            :meth:`mark_ready` calls (local accumulation between reductions).
        algorithm: the allreduce algorithm (default: the ``allreduce_algorithm`` setting).
        as_array: turns what :meth:`mark_ready` and ``missing`` give into the array to
            reduce, on the collectives thread, and returns arrays unchanged. A
            framework whose gradients always have their parameter's shape and dtype
            (PyTorch) passes its tensors and this converter, which keeps
            :meth:`mark_ready` cheap: it then checks nothing.

    Attributes:
        buckets: the fusion buckets, in launch order.
        step_weight: None, or a function called once per step, on the thread that
            launches the step's first bucket, whose result multiplies the prescale of
            every bucket of the step (a load balancer's weight of this rank's samples).
        last_step_bytes: the bytes this rank handed to the allreduces of the last step
            that :meth:`wait` finished (counted as :attr:`bytes_per_step` counts them).

    Raises:
        InvalidArgumentError, UnsupportedDtypeError: duplicate or empty names, bad
            arguments, a dtype that cannot be reduced with ``op``; before any
            communication.
    """

    def __init__(self, gradients: Sequence[tuple[str, Any]], op: ReduceOp = Average,
                 compression: Compressor = Compression.none, prescale_factor: float = 1.0,
                 postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                 fusion_threshold: int | None = None,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 backward_passes_per_step: int = 1, algorithm: str | None = None,
                 as_array: Callable[[Any], Any] | None = None):
        if op is ReduceOp.Adasum or (isinstance(op, str) and op.lower() == "adasum"):
            raise InvalidArgumentError(
                "op Adasum combines each parameter's change, not bucketed gradients: use "
                "ringtrain.horovod.DistributedOptimizer(optimizer, op=hvd.Adasum)")
        self.specs = _specs(gradients)
        self._as_array = as_array
        self.process_set = process_set
        self.fusion_threshold = resolve_fusion_threshold(fusion_threshold)
        self.backward_passes_per_step = backward_passes_per_step
        self._first_bucket_bytes = first_bucket_bytes
        self._prescale = prescale_factor
        self._postscale = postscale_factor
        self._plan_arguments = (op, postscale_factor, process_set, algorithm, compression)
        self._kept: list[KeptElements | None] = [None] * len(self.specs)
        self._lock = threading.Lock()
        self.step_prologue: Callable[[], None] | None = None
        self.step_weight: Callable[[], float] | None = None
        self.last_step_bytes = 0
        self._build_buckets()
        self._reset()

    def _build_buckets(self) -> None:
        """Assign the buckets from the gradients' sizes (their kept elements' where
        masked) and plan their allreduces."""
        sizes = [spec if kept is None else GradientSpec(spec.name, (kept.count,), spec.dtype)
                 for spec, kept in zip(self.specs, self._kept)]
        groups = assign_buckets(sizes, self.fusion_threshold, self._first_bucket_bytes,
                                copied=[kept is not None for kept in self._kept])
        self.buckets = [Bucket(i, len(groups), members, self.specs, self._kept)
                        for i, members in enumerate(groups)]
        self._bucket_of = [0] * len(self.specs)
        for bucket in self.buckets:
            for index in bucket.members:
                self._bucket_of[index] = bucket.index
        op, postscale_factor, process_set, algorithm, compression = self._plan_arguments
        self._plans = [allreduce_plan(self._bucket_spec(bucket), op, bucket.name, 1.0,
                                      postscale_factor, process_set, algorithm, compression,
                                      _COLLECTIVE)
                       for bucket in self.buckets]
        self._device_plans: dict[int, Any] = {}
        self._wire_bytes = [bucket.layout.total_size * wire_itemsize(compression,
                                                                     bucket.layout.dtype)
                            for bucket in self.buckets]

    def set_masks(self, masks: Sequence[Any]) -> None:
        """Reduce only the kept elements of masked gradients from the next step on.

        Every rank must give the same masks (ranks that do not get a MismatchError from
        the first bucket that differs, on every rank). The buckets are assigned again
        from the kept sizes; the pruned elements of a masked gradient are set to zero by
        each reduction. Device gradients cannot be masked (the step raises UsageError).

        Args:
            masks: one entry per gradient, in registration order: an array of the
                gradient's shape (nonzero: kept), or None for a gradient sent whole. A
                mask that keeps everything counts as None.

        Raises:
            InvalidArgumentError: not one mask per gradient, or a mask of another shape.
            UsageError: called while a step's gradients are being reduced.
        """
        masks = list(masks)
        if len(masks) != len(self.specs):
            raise InvalidArgumentError(
                f"set_masks: got {len(masks)} masks for {len(self.specs)} gradients")
        kept = [kept_elements(spec.name, spec.shape, mask)
                for spec, mask in zip(self.specs, masks)]
        if self.in_progress():
            raise UsageError("set_masks() was called while gradients are being reduced; call "
                             "it before backward() or after step()")
        self._kept = kept
        self._build_buckets()
        self._reset()

    @property
    def bytes_per_step(self) -> int:
        """The bytes each rank hands to the allreduces of a step, with the current masks
        (each bucket's buffer, padding included; float32 counted as 2 bytes when
        compressed to fp16 or bf16)."""
        return sum(self._wire_bytes)

    @property
    def backward_passes_per_step(self) -> int:
        """How many :meth:`mark_ready` calls make a gradient ready."""
        return self._passes_per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise InvalidArgumentError(
                f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self._passes_per_step = passes

    def index_of(self, name: str) -> int:
        """The index of the gradient called ``name``.

        Raises:
            InvalidArgumentError: no gradient has that name.
        """
        index = self._index_by_name.get(name)
        if index is None:
            raise InvalidArgumentError(f"no gradient is called {name!r}")
        return index

    @functools.cached_property
    def _index_by_name(self) -> dict[str, int]:
        return {spec.name: i for i, spec in enumerate(self.specs)}

    def in_progress(self) -> bool:
        """True between the first :meth:`mark_ready` of a step and its :meth:`wait`."""
        with self._lock:
            return self._started

    def check_accumulation(self, index: int) -> None:
        """Raise UsageError if gradient ``index`` already had all its backward passes this
        step: adding to it now would race with its reduction. Frameworks that can call
        this before accumulating (PyTorch's tensor hooks) keep the gradient intact."""
        if self._passes[index] >= self._passes_per_step:
            raise UsageError(self._too_many_passes(index, self._passes[index] + 1))

    def _too_many_passes(self, index: int, passes: int) -> str:
        return (f"gradient {self.specs[index].name!r} was computed {passes} times before "
                f"step() or synchronize(), but backward_passes_per_step is "
                f"{self._passes_per_step}; raise backward_passes_per_step to accumulate "
                f"gradients locally over more passes")

    def mark_ready(self, index: int, gradient: np.ndarray) -> None:
        """Say that ``gradient`` (the array of gradient ``index``) got one more backward pass.

        On its ``backward_passes_per_step``-th call in a step the gradient is final; from
        then on until :meth:`wait` returns it must not be written (its bucket may be
        reducing it in place). May be called from any thread.

        Raises:
            InvalidArgumentError: the array's shape or dtype is not the registered one.
            UsageError: more backward passes than ``backward_passes_per_step`` before
                :meth:`wait`.
        """
        if self._as_array is None:
            self._check(index, gradient)
        with self._lock:
            self._started = True
            passes = self._passes[index] + 1
            if passes < self._passes_per_step:
                self._passes[index] = passes
                return
            if passes > self._passes_per_step:
                raise UsageError(self._too_many_passes(index, passes))
            self._passes[index] = passes
            self._gradients[index] = gradient
            bucket = self._bucket_of[index]
            self._missing[bucket] -= 1
            if bucket == self._next_launch and not self._missing[bucket]:
                self._launch_ready_buckets()

    def _check(self, index: int, gradient: Any) -> None:
        spec = self.specs[index]
        if type(gradient) is np.ndarray:
            shape, dtype = gradient.shape, gradient.dtype
        else:
            shape, dtype = tuple(gradient.shape), dtype_of(gradient)
        if shape != spec.shape or dtype != spec.dtype:
            raise InvalidArgumentError(
                f"gradient {spec.name!r} has shape {shape} and dtype {dtype}; registered "
                f"as {spec.shape} {spec.dtype}")

    def wait(self, missing: Callable[[int], np.ndarray] | None = None) -> None:
        """Finish the step: launch what is left, wait for every bucket, and return once
        all gradients hold the reduced values.

        Args:
            missing: gives the array of gradient ``index`` when it was not marked ready
                this step (a parameter that got no gradient); the array is reduced like
                the others (zeros contribute nothing to a sum). Without it, such a
                gradient contributes zeros, its result is dropped, and UsageError
                follows once the step is complete on every rank.

        Raises:
            Whatever a bucket's allreduce raised (e.g. :class:`~ringtrain.MismatchError`
            on every rank when ranks hold different models), with a note naming the
            bucket; once one bucket failed, the later ones of the step are not sent.
        """
        unmarked = []
        with self._lock:
            for bucket in self.buckets[self._next_launch:]:
                for index in bucket.members:
                    if self._gradients[index] is None:
                        spec = self.specs[index]
                        if missing is None:
                            unmarked.append(index)
                            self._gradients[index] = self._zeros_like_marked(spec)
                        else:
                            self._gradients[index] = missing(index)
                self._missing[bucket.index] = 0
            self._launch_ready_buckets()
            handles = self._handles
            self.last_step_bytes = self._step_bytes
            self._reset()
        _wait_all(handles)
        if unmarked:
            names = ", ".join(repr(self.specs[i].name) for i in sorted(unmarked))
            raise UsageError(
                f"gradient(s) {names} were not marked ready this "
                f"step; they were reduced as zeros and their results dropped")

    def _zeros_like_marked(self, spec: GradientSpec) -> Any:
        """Zeros where the step's gradients live (host, or the device of a marked one)."""
        marked = next((g for g in self._gradients if g is not None), None)
        if marked is not None and self._as_array is not None:
            marked = self._as_array(marked)
        if marked is None or twin_for(marked) is host:
            return np.zeros(spec.shape, spec.dtype)
        return twin_for(marked).zeros(marked, spec.shape, spec.dtype)

    @staticmethod
    def _bucket_spec(bucket: Bucket) -> np.ndarray:
        return np.empty(bucket.layout.total_size, bucket.layout.dtype)

    def _device_plan(self, index: int) -> Any:
        """The plan of bucket ``index`` for device gradients, made when first needed."""
        plan = self._device_plans.get(index)
        if plan is None:
            op, postscale_factor, process_set, algorithm, compression = self._plan_arguments
            bucket = self.buckets[index]
            plan = self._device_plans[index] = allreduce_plan(
                self._bucket_spec(bucket), op, bucket.name, 1.0, postscale_factor,
                process_set, algorithm, compression, _COLLECTIVE, on_device=True)
        return plan

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and \
                self._missing[self._next_launch] == 0:
            if self._next_launch == 0:
                self._start_step()
            bucket = self.buckets[self._next_launch]
            gradients = [self._gradients[i] for i in bucket.members]
            body = functools.partial(self._step.run, bucket.reduce, self._plans[bucket.index],
                                     functools.partial(self._device_plan, bucket.index),
                                     gradients, self._step_prescale, self._postscale,
                                     self._as_array)
            self._handles.append(submit(_COLLECTIVE, bucket.name, body, self.process_set))
            self._step_bytes += self._wire_bytes[bucket.index]
            self._next_launch += 1

    def _start_step(self) -> None:
        """Before the step's first bucket: its prescale, and the prologue (if any)."""
        weight = self.step_weight
        self._step_prescale = self._prescale if weight is None else self._prescale * weight()
        if self.step_prologue is not None:
            self._handles.append(submit(_COLLECTIVE, "step prologue",
                                        functools.partial(self._step.run, self.step_prologue),
                                        self.process_set))

    def _reset(self) -> None:
        self._step = _Step()
        self._step_prescale = self._prescale
        self._started = False
        self._next_launch = 0
        self._step_bytes = 0
        self._handles: list[Handle] = []
        self._passes = [0] * len(self.specs)
        self._gradients: list[np.ndarray | None] = [None] * len(self.specs)
        self._missing = [len(bucket.members) for bucket in self.buckets]

    def __repr__(self) -> str:
        return (f"GradientReducer({len(self.specs)} gradients in {len(self.buckets)} "
                f"buckets, fusion threshold {self.fusion_threshold} bytes)")


def wire_itemsize(compression: Compressor, dtype: np.dtype) -> int:
    """Bytes per element of ``dtype`` on the wire under ``compression``."""
    if compression.applies_to(dtype):
        return compression.wire_dtype.itemsize
    return dtype.itemsize


def predivide_factors(op: ReduceOp, gradient_predivide_factor: float) -> tuple[float, float]:
    """The (prescale, postscale) pair that splits an average's division around the sum:
    divide by ``gradient_predivide_factor`` before, by ``size / factor`` after.

    Raises:
        InvalidArgumentError: a factor other than 1 with an op other than Average, or a
            factor that is not a positive number.
    """
    if not isinstance(gradient_predivide_factor, (int, float)) or \
            isinstance(gradient_predivide_factor, bool) or not gradient_predivide_factor > 0:
        raise InvalidArgumentError(
            f"gradient_predivide_factor must be a positive number, got "
            f"{gradient_predivide_factor!r}")
    if gradient_predivide_factor == 1.0:
        return 1.0, 1.0
    if op is not Average:
        raise InvalidArgumentError(
            f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, got {op}")
    return 1.0 / gradient_predivide_factor, float(gradient_predivide_factor)


class _Step:
    """One step's reductions as they run on the collectives thread.

    Once one of them fails, the rest are skipped without communicating: the failures
    that can happen here (a MismatchError) happen on every rank alike, so every rank
    skips the same ones and nobody waits for a message that will not come.
    """

    def __init__(self) -> None:
        self.failure: BaseException | None = None

    def run(self, reduction: Callable[..., None], *args: Any) -> None:
        """Run ``reduction(*args)`` unless an earlier one of this step failed."""
        if self.failure is not None:
            raise UsageError(f"not sent: an earlier reduction of this step failed "
                             f"({type(self.failure).__name__})")
        try:
            reduction(*args)
        except BaseException as error:
            self.failure = error
            raise


def _wait_all(handles: list[Handle]) -> None:
    """Wait for every handle; raise the first failure (in launch order) once all are done.

    The collectives thread runs them in order, so waiting for the last first wakes this
    thread once instead of once per bucket.
    """
    failures: list[tuple[Handle, BaseException]] = []
    for handle in reversed(handles):
        try:
            handle.wait()
        except BaseException as error:  # the others must still finish first
            failures.append((handle, error))
    if failures:
        handle, error = failures[-1]
        error.add_note(f"while reducing {handle.name}")
        raise error


def _specs(gradients: Sequence[tuple[str, Any]]) -> list[GradientSpec]:
    specs = []
    for position, entry in enumerate(gradients):
        try:
            name, like = entry
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"gradient {position}: expected a (name, array) pair, got {entry!r}") from None
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"gradient {position}: the name must be a non-empty string, got {name!r}")
        specs.append(GradientSpec(name, tuple(int(n) for n in like.shape),
                                  np.dtype(like.dtype)))
    duplicates = repeated_names(spec.name for spec in specs)
    if duplicates:
        raise InvalidArgumentError(
            f"gradient names must be unique; repeated: {', '.join(map(repr, duplicates))}")
    return specs
