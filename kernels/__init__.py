"""Array kernels used by ringtrain's collectives and trainer.

Pure array code: nothing here imports mpi4py or knows about ranks. Each kernel has a
host twin (:mod:`.host`, numpy and ``numba.njit``) and a device twin (:mod:`.device`,
``numba.cuda``) of the same signature; the functions exported here pick the twin from
the arrays they are given.
"""

from .compression import (BF16Compressor, Compression, CompressionContext, Compressor,
                          FP16Compressor, NoneCompressor)
from .dispatch import (abs_max, decode_bfloat, decode_half, dequantize_2bit, divide_into,
                       empty_like, encode_bfloat, encode_half, gather_indexed, pack,
                       quantize_2bit, reduce_into, scale_into, scatter_indexed, twin_for,
                       unpack, zeros_like)
from .dtypes import BFLOAT16, bits, encoding_of, is_floating
from .host import OP_CODES, host_threads, set_host_threads
from .layout import FusionLayout
from .reduction import reducer

__all__ = [
    "BFLOAT16", "BF16Compressor", "Compression", "CompressionContext", "Compressor",
    "FP16Compressor", "FusionLayout", "NoneCompressor", "OP_CODES", "abs_max", "bits",
    "decode_bfloat", "decode_half", "dequantize_2bit", "divide_into", "empty_like",
    "encode_bfloat", "encode_half", "encoding_of", "gather_indexed", "host_threads",
    "is_floating", "pack", "quantize_2bit", "reduce_into", "reducer", "scale_into",
    "scatter_indexed", "set_host_threads", "twin_for", "unpack", "zeros_like",
]
