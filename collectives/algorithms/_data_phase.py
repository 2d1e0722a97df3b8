"""The data phase of an allreduce on host memory, after the ranks agreed: one flat
buffer through the chosen algorithm."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mpi4py import MPI
import numpy as np

from ...kernels import Compressor, bits, encoding_of, reducer
from ...kernels.reduction import Combine
from ..base._group import Group
from ..base._ops import ReduceOp
from ..base._tracing import phase
from ..config import current_settings
from ..transport import _recursive_doubling
from ..transport._compiled_exchange import reduce_by_recursive_doubling
from ..world._topology import HIERARCHICAL, NodeLayout, hierarchy_for, layout_of
from . import _adasum, _hierarchical, _native
from ._compiled_ring import allreduce_by_ring
from ._selection import ADASUM


def reduce_flat(group: Group, algorithm: str, source: np.ndarray, result: np.ndarray,
                op: ReduceOp, combine: Combine | None,
                finish: Callable[[np.ndarray], None] | None, segment_bytes: int,
                encoding: str | None = None, layout: NodeLayout | None = None,
                bounds: Sequence[int] | None = None) -> None:
    """The data phase of an allreduce, after agreement: 1-D ``source`` into ``result``.

    ``combine`` reduces two ranks' values (see :func:`ringtrain.kernels.reducer`);
    ``encoding`` names a 16-bit float format stored as uint16; ``layout`` is the one
    the call agreed on (the hierarchical algorithms need it). bfloat16 arrays travel as
    their bits (MPI has no bfloat16), so ``combine`` and ``finish`` must take those.
    The ``adasum`` algorithm needs no ``combine``, takes its values as they are, and
    ``bounds``, the offsets of the tensors packed in ``source`` (None: one tensor).
    """
    if algorithm == ADASUM:
        with phase("adasum", bytes=source.nbytes):
            _adasum.allreduce(group, source, result, finish, bounds)
        return
    encoding = encoding or encoding_of(source.dtype)
    in_place = result is source
    source = bits(source)
    result = source if in_place else bits(result)
    if group.size == 1 or source.size == 0:
        if result is not source:
            result[:] = source
    elif algorithm in HIERARCHICAL:
        hierarchy = hierarchy_for(group, layout or layout_of(group, current_settings()))
        hierarchical_schedule(algorithm)(hierarchy, source, result, combine, finish,
                                         segment_bytes)
        return
    elif algorithm == "ring":
        allreduce_by_ring(group, source, result, combine, finish, segment_bytes)
        return
    elif algorithm == "recursive_doubling":
        if result is not source:
            result[:] = source
        with phase("recursive doubling", bytes=result.nbytes):
            recursive_doubling_allreduce(group, result, combine, segment_bytes)
    elif encoding is not None or result.dtype == np.float16:
        send = MPI.IN_PLACE if result is source else [source.view(np.uint16), MPI.UINT16_T]
        _native.allreduce(group, send, [result.view(np.uint16), MPI.UINT16_T],
                          _native.sixteen_bit_op(op, encoding), result.nbytes)
    else:
        _native.allreduce(group, MPI.IN_PLACE if result is source else source, result,
                          _native.MPI_OPS[op], result.nbytes)
    if finish is not None:
        finish(result)


def recursive_doubling_allreduce(group: Group, buffer: np.ndarray, combine: Combine,
                                 segment_bytes: int) -> None:
    """Allreduce 1-D ``buffer`` in place by recursive doubling, after the agreement: one
    compiled call, or the same steps in Python where the compiled exchange is off."""
    if not reduce_by_recursive_doubling(group, buffer, combine, segment_bytes):
        _recursive_doubling.allreduce(group, buffer, combine, segment_bytes)


def reduce_hierarchical(group: Group, algorithm: str, layout: NodeLayout, source: np.ndarray,
                        result: np.ndarray, op: ReduceOp, segment_bytes: int,
                        wire: _hierarchical.Wire) -> None:
    """A compressed hierarchical allreduce after agreement: full precision inside the
    nodes, ``wire``'s format between them; ``wire`` applies the scales."""
    if source.size == 0 or group.size == 1:
        if result is not source:
            result[:] = source
        np.multiply(result, wire.decode_scale * wire.encode_scale, out=result)
        return
    hierarchical_schedule(algorithm)(hierarchy_for(group, layout), source, result,
                                     reducer(op.value, source.dtype), None, segment_bytes,
                                     wire)


def hierarchical_wire(compressor: Compressor, wire: np.ndarray, op: ReduceOp,
                      encode_scale: float, decode_scale: float,
                      name: str | None) -> _hierarchical.Wire:
    """What a compressed hierarchical allreduce sends between nodes: ``compressor``'s
    format in ``wire``, the scales applied by the casts."""
    return _hierarchical.Wire(compressor, wire,
                              reducer(op.value, wire.dtype, compressor.encoding),
                              encode_scale, decode_scale, name)


def hierarchical_schedule(algorithm: str) -> Callable[..., None]:
    """The function of a hierarchical algorithm (``hierarchical`` or ``node_leader``)."""
    return _hierarchical.allreduce if algorithm == "hierarchical" else \
        _hierarchical.leader_allreduce
