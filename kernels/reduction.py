"""The reduction step of the collectives: ``out = a (op) b``, and scaling, on host arrays.

Every function writes into ``out`` and allocates nothing, so the ring can reduce each
received segment straight into its destination while the segment is still in cache.
"""

from __future__ import annotations

import numpy as np

REDUCTION_UFUNCS: dict[str, np.ufunc] = {
    "sum": np.add,
    "average": np.add,
    "min": np.minimum,
    "max": np.maximum,
    "product": np.multiply,
}
"""The elementwise function that combines two ranks' values, by op name.

Average sums; the collectives scale the sum afterwards.
"""


def reduce_into(op: str, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """Set ``out = a (op) b`` elementwise; ``out`` may be ``a`` or ``b``.

    Args:
        op: a key of :data:`REDUCTION_UFUNCS`.
        a, b: operands of ``out``'s shape and dtype.
        out: destination.
    """
    REDUCTION_UFUNCS[op](a, b, out=out)


def scale_into(a: np.ndarray, factor: float, out: np.ndarray) -> None:
    """Set ``out = a * factor`` in ``out``'s dtype; a no-op copy-free path when factor is 1.

    Args:
        a: source, of ``out``'s shape.
        factor: the scale.
        out: destination; may be ``a``.
    """
    if factor == 1.0:
        if out is not a:
            np.copyto(out, a)
        return
    np.multiply(a, factor, out=out, casting="unsafe")
