"""``ringtrain-bench``: collective microbenchmarks in the conventions of nccl-tests.

Run under MPI (``mpiexec -n 4 ringtrain-bench allreduce -b 8 -e 64M -f 4``, or
``python -m ringtrain.collectives.bench``). Every size is measured for every requested
algorithm in turn, ``native`` being the MPI library's own collective called directly on
the same buffers, so a ratio column compares ringtrain with the MPI in the same run. With
``--device cuda`` every ringtrain algorithm is also measured on GPU buffers (CuPy, torch
or numba device arrays), and a second ratio column compares them with host buffers.
"""

from .cli import main

__all__ = ["main"]
