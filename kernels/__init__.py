"""Array kernels used by ringtrain's collectives and trainer.

Pure array code: nothing here imports mpi4py or knows about ranks.
"""

from .reduction import REDUCTION_UFUNCS, reduce_into, scale_into

__all__ = ["REDUCTION_UFUNCS", "reduce_into", "scale_into"]
