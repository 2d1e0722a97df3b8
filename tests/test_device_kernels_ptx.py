"""Every GPU kernel compiles for a real GPU (Hopper, compute capability 9.0), with the
argument types ``ringtrain.kernels.device`` launches it with.

The simulator runs the kernels' Python source, and so cannot catch what only numba's CUDA
compiler sees: typing on the device (raw-address loads and stores, rounding intrinsics,
numpy scalar types). ``cuda.compile_ptx`` needs no GPU, only NVVM and NVRTC (the
``cuda-toolkit`` wheels); the test skips without them.

Two faults first seen on a GPU are checked in the PTX: a kernel must not call code linked
in from outside (``.extern .func``: numba's float16 arithmetic does, and a kernel so
linked fails when numba caches it), and the pack and unpack kernels must store elements
of the tensor's own width (an int32 product typed int64 was once stored as 8 bytes).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

PROBE = r'''
import numpy as np
from numba import cuda, types
from numba.np.numpy_support import from_dtype
from ringtrain.kernels import device
from types import SimpleNamespace
import numba.cuda.dispatcher

# Device functions called by a kernel are compiled for the current device's compute
# capability; without a GPU there is none, so name the target's.
numba.cuda.dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))

def array(dtype, ndim=1):
    return types.Array(from_dtype(np.dtype(dtype)), ndim, "C")

def scalar(dtype):
    return from_dtype(np.dtype(dtype))

NUMERIC = ["float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64"]
COPIED = NUMERIC + ["bool", "uint16"]
signatures = []
for dtype in COPIED:
    for kernel in (device._pack_kernel, device._unpack_kernel):
        signatures.append((kernel, (array(np.int64, 2), array(np.int64), array(np.int64),
                                    array(dtype), scalar(dtype), types.boolean)))
for dtype in NUMERIC:
    signatures.append((device._reduce_native, (array(dtype),) * 3 + (types.int64,)))
for dtype in ("float16", "float32", "float64"):
    signatures.append((device._scale_kernel, (array(dtype), scalar(dtype), array(dtype))))
    signatures.append((device._divide_kernel, (array(dtype), scalar(dtype), array(dtype))))
for dtype in ("float32", "float64"):
    signatures.append((device._abs_max_kernel,
                       (array(dtype), array(dtype), array(np.int64))))
for encode, feedback, decode, reduce in (
        (device._encode_half, device._encode_half_feedback, device._decode_half,
         device._reduce_half),
        (device._encode_bfloat, device._encode_bfloat_feedback, device._decode_bfloat,
         device._reduce_bfloat)):
    signatures.append((encode, (array(np.float32), array(np.uint16), types.float32)))
    signatures.append((feedback, (array(np.float32), array(np.uint16), types.float32,
                                  array(np.float32), types.float32)))
    signatures.append((decode, (array(np.uint16), array(np.float32), types.float32)))
signatures.append((device._reduce_half, (array(np.uint16),) * 3 + (types.int64,)))
signatures.append((device._reduce_bfloat, (array(np.uint16),) * 3 + (types.int64,)))
for kernel in (device._pack_bfloat_kernel, device._unpack_bfloat_kernel):
    signatures.append((kernel, (array(np.int64, 2), array(np.int64), array(np.int64),
                                array(np.uint16), types.float32)))
for kernel in (device._scale_bfloat_kernel, device._divide_bfloat_kernel):
    signatures.append((kernel, (array(np.uint16), types.float32, array(np.uint16))))
signatures.append((device._quantize_2bit_kernel, (array(np.float32), array(np.float32),
                                                  array(np.uint32), types.float32)))
signatures.append((device._dequantize_2bit_kernel, (array(np.uint32), array(np.float32),
                                                    types.float32)))
for unsigned in (np.uint8, np.uint16, np.uint32, np.uint64):
    signatures.append((device._gather_kernel, (array(unsigned), array(np.int64),
                                               array(unsigned))))
    signatures.append((device._scatter_kernel, (array(unsigned), array(np.int64),
                                                array(unsigned))))
    signatures.append((device._zero_kernel, (array(unsigned),)))

def store_widths(ptx):
    """Bits of each store to global or generic memory (``st.global.u32`` is 32)."""
    opcodes = {line.split()[0] for line in ptx.splitlines() if line.strip().startswith("st.")}
    return {int(op.rsplit(".", 1)[1][1:]) for op in opcodes
            if not op.startswith(("st.param", "st.local", "st.shared"))}

failures = []
for kernel, signature in signatures:
    name = f"{kernel.py_func.__name__}{signature}"
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
    except Exception as error:
        failures.append(f"{name}: {type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''}")
        continue
    if ".extern .func" in ptx:
        failures.append(f"{name}: calls code linked from outside (.extern .func)")
    if kernel in (device._pack_kernel, device._unpack_kernel):
        element_bits = 8 * np.dtype(str(signature[3].dtype)).itemsize
        if store_widths(ptx) != {element_bits}:
            failures.append(f"{name}: stores of {sorted(store_widths(ptx))} bits, "
                            f"the elements have {element_bits}")
print(f"compiled {len(signatures) - len(failures)} of {len(signatures)}")
for failure in failures:
    print("FAILED", failure)
'''


def _compiler_missing() -> str | None:
    """Why PTX cannot be made here (None when it can)."""
    probe = ("from numba import cuda, float32\n"
             "cuda.compile_ptx(lambda a: None, (float32[:],), cc=(9, 0))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env=_environment(), timeout=300)
    if result.returncode == 0:
        return None
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else "cuda.compile_ptx failed"


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}


def test_every_kernel_compiles_for_compute_capability_9():
    missing = _compiler_missing()
    if missing:
        pytest.skip(f"no CUDA compiler for PTX (install cuda-toolkit[nvrtc,nvvm]): {missing}")
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            env=_environment(), timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout, result.stdout
    assert "compiled" in result.stdout and " of 0" not in result.stdout, result.stdout
