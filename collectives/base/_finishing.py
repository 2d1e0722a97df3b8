"""The step that turns a sum into an allreduce's result: divide (Average), then scale."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...kernels import divide_into, encoding_of, scale_into


@dataclass(frozen=True)
class Finisher:
    """The in-place step that turns a sum into the result: divide by ``divisor`` (for
    Average), then multiply by ``postscale_factor``. Calling it applies it to host values
    (bfloat16 ones, ``encoding``, also as their uint16 bits, as the data phase holds
    them); device memory applies the same two numbers on the GPU."""

    divisor: int
    postscale_factor: float
    encoding: str | None = None

    def __call__(self, values: np.ndarray) -> None:
        self.into(values, values)

    def into(self, values: np.ndarray, out: np.ndarray) -> None:
        """Apply it to host ``values``, writing ``out`` (may be ``values``)."""
        if self.divisor != 1:
            divide_into(values, self.divisor, out, self.encoding)
            values = out
        if self.postscale_factor != 1.0:
            scale_into(values, self.postscale_factor, out, self.encoding)
        elif values is not out:
            np.copyto(out, values)


def finisher(divisor: int, postscale_factor: float, dtype: np.dtype) -> Finisher | None:
    """The :class:`Finisher` for these numbers and values of ``dtype``, or None when it
    would do nothing."""
    if divisor == 1 and postscale_factor == 1.0:
        return None
    return Finisher(divisor, postscale_factor, encoding_of(dtype))
