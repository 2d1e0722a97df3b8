"""GPU twins of the kernels: ``numba.cuda`` kernels for device arrays.

The only module of ringtrain that imports ``numba.cuda``; nothing imports it until a
device array is seen. Every function has a twin of the same name and signature in
``host`` and gives the same bits (the 16-bit float formats go through the same integer
code, ``float_bits``), except for NaN payloads where a kernel does arithmetic: a GPU
returns its canonical NaN there, the host the operand's.

Arrays may be numba device arrays, CuPy arrays, torch CUDA tensors (``.detach()``-ed)
or anything else with ``__cuda_array_interface__``; they must be C-contiguous. Kernels
are launched on the stream the first array's interface names (CuPy: its current stream)
or on the default stream, so they run after the work that produced the data without
a host synchronisation; arrays from different streams must be synchronised by the
caller first. All loops are grid-stride, so one launch covers any size; a fusion buffer
is packed or unpacked in one launch whatever the number of tensors, each block copying
whole rows of the layout's task table.

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same kernel source runs on the
CPU: loads and stores through raw addresses read host memory there, launches use a few
threads, and the arrays are the simulator's; objects exposing ``__cuda_array_interface__``
count as device arrays too (their memory is host memory, as the simulated device's is).

bfloat16 device memory is any array whose interface's typestr numpy maps to bfloat16
(``"bfloat16"``), or the simulator's arrays over bfloat16 host memory; the kernels see
its 16 bits as uint16, and new bfloat16 arrays are :class:`BfloatDeviceArray` (numba has
no bfloat16 type).

Besides the kernels, the few device-memory operations the collectives need live here:
allocation, pinned host buffers, copies (:class:`CopyEngine` for asynchronous ones),
stream waits and the current device.
"""

from __future__ import annotations

import contextlib
import functools
import ctypes
import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import cuda

from . import float_bits, two_bit
from .dtypes import BFLOAT16, BFLOAT16_ENCODING, BFLOAT16_TYPESTR, encoding_of
from .layout import FusionLayout

SIMULATED = "simulator" in cuda.to_device.__module__
"""True under numba's CUDA simulator."""

THREADS_PER_BLOCK = 8 if SIMULATED else 256
MAX_BLOCKS = 2 if SIMULATED else 4096

OP_CODES = {"sum": 0, "average": 0, "min": 1, "max": 2, "product": 3}

if SIMULATED:
    def load(address, index, like):
        """``like.dtype`` element ``index`` of the array starting at ``address``."""
        itemsize = like.dtype.itemsize
        raw = (ctypes.c_char * itemsize).from_address(int(address) + int(index) * itemsize)
        return np.frombuffer(raw, like.dtype)[0]

    def store(address, index, value, like):
        """Write ``value`` as element ``index`` of the ``like.dtype`` array starting at
        ``address``."""
        itemsize = like.dtype.itemsize
        raw = (ctypes.c_char * itemsize).from_address(int(address) + int(index) * itemsize)
        np.frombuffer(raw, like.dtype)[0] = value

    def widened(value):
        """float16 ``value`` as float32 (exactly); any other value as it is."""
        return np.float32(value) if isinstance(value, np.float16) else value

    def multiply_rn(x, y):
        """``x * y`` rounded on its own."""
        return x * y
else:
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load(typingctx, address, index, like):
        """``like.dtype`` element ``index`` of the array starting at ``address``."""
        element = like.dtype

        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], context.get_value_type(element).as_pointer())
            return builder.load(builder.gep(pointer, [args[1]]))

        return element(address, index, like), codegen

    @intrinsic
    def store(typingctx, address, index, value, like):
        """Write ``value`` as element ``index`` of the ``like.dtype`` array starting at
        ``address``."""
        element = like.dtype

        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], context.get_value_type(element).as_pointer())
            stored = context.cast(builder, args[2], value, element)
            builder.store(stored, builder.gep(pointer, [args[1]]))
            return context.get_dummy_value()

        return types.void(address, index, value, like), codegen

    @intrinsic
    def widened(typingctx, value):
        """float16 ``value`` as float32 (exactly); any other value as it is.

        float16 arithmetic in numba's CUDA target calls functions linked in from C++, and a
        kernel linked so cannot be cached. A float32 product, sum or quotient of float16
        values rounded to float16 is the correctly rounded float16 result (float32 has more
        than twice float16's precision plus two bits), as on the host."""
        result = types.float32 if value == types.float16 else value

        def codegen(context, builder, signature, args):
            return context.cast(builder, args[0], value, result)

        return result(value), codegen

    # A product that the compiler may not fuse with the add after it into one FMA
    # (which rounds once where the host twin rounds twice).
    from numba.cuda.libdevice import fmul_rn as multiply_rn


def _device_function(function: Callable) -> Callable:
    return cuda.jit(device=True, inline=True)(function)


_half_from_float = _device_function(float_bits.half_bits_from_float_bits)
_float_from_half = _device_function(float_bits.float_bits_from_half_bits)
_bfloat_from_float = _device_function(float_bits.bfloat_bits_from_float_bits)
_float_from_bfloat = _device_function(float_bits.float_bits_from_bfloat_bits)
_quantize_word = _device_function(two_bit.quantize_word)
_dequantized = _device_function(two_bit.dequantized)


def _kernel(function: Callable) -> Callable:
    return cuda.jit(cache=not SIMULATED)(function)


@_kernel
def _pack_kernel(tasks, offsets, addresses, buffer, scale, scaled):
    for task in range(cuda.blockIdx.x, tasks.shape[0], cuda.gridDim.x):
        tensor, start, count = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        if tensor < 0:
            for i in range(cuda.threadIdx.x, count, cuda.blockDim.x):
                buffer[start + i] = 0
        else:
            address, base = addresses[tensor], offsets[tensor] + start
            for i in range(cuda.threadIdx.x, count, cuda.blockDim.x):
                # apart: a value through float32 would lose a float16 NaN's payload
                if scaled:
                    buffer[base + i] = widened(load(address, start + i, buffer)) * \
                        widened(scale)
                else:
                    buffer[base + i] = load(address, start + i, buffer)


@_kernel
def _unpack_kernel(tasks, offsets, addresses, buffer, scale, scaled):
    for task in range(cuda.blockIdx.x, tasks.shape[0], cuda.gridDim.x):
        tensor, start, count = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        if tensor >= 0:
            address, base = addresses[tensor], offsets[tensor] + start
            for i in range(cuda.threadIdx.x, count, cuda.blockDim.x):
                if scaled:
                    store(address, start + i, widened(buffer[base + i]) * widened(scale),
                          buffer)
                else:
                    store(address, start + i, buffer[base + i], buffer)


def _encoder(to_bits: Callable, from_bits: Callable) -> tuple[Callable, Callable]:
    def encode(source, wire, scale):
        if scale == 1:  # no product: it would quiet a signalling NaN, as on the host
            for i in range(cuda.grid(1), source.size, cuda.gridsize(1)):
                wire[i] = to_bits(np.float32(source[i]).view(np.uint32))
        else:
            for i in range(cuda.grid(1), source.size, cuda.gridsize(1)):
                wire[i] = to_bits(np.float32(source[i] * scale).view(np.uint32))

    def encode_feedback(source, wire, scale, residual, inverse):
        for i in range(cuda.grid(1), source.size, cuda.gridsize(1)):
            value = source[i] + residual[i]
            bits = to_bits(np.float32(value * scale).view(np.uint32))
            wire[i] = bits
            residual[i] = value - multiply_rn(np.uint32(from_bits(bits)).view(np.float32),
                                              inverse)

    return _kernel(encode), _kernel(encode_feedback)


def _decoder(from_bits: Callable) -> Callable:
    def decode(wire, out, scale):
        if scale == 1:  # no product: it would quiet a signalling NaN, as on the host
            for i in range(cuda.grid(1), wire.size, cuda.gridsize(1)):
                out[i] = np.uint32(from_bits(wire[i])).view(np.float32)
        else:
            for i in range(cuda.grid(1), wire.size, cuda.gridsize(1)):
                out[i] = np.uint32(from_bits(wire[i])).view(np.float32) * scale

    return _kernel(decode)


@_device_function
def _scaled_bfloat(bits, factor):
    """bfloat16 ``bits`` times float32 ``factor``: computed in float32, rounded once."""
    x = np.uint32(_float_from_bfloat(bits)).view(np.float32)
    return np.uint16(_bfloat_from_float(np.float32(x * factor).view(np.uint32)))


@_kernel
def _pack_bfloat_kernel(tasks, offsets, addresses, buffer, scale):
    for task in range(cuda.blockIdx.x, tasks.shape[0], cuda.gridDim.x):
        tensor, start, count = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        if tensor < 0:
            for i in range(cuda.threadIdx.x, count, cuda.blockDim.x):
                buffer[start + i] = 0
        else:
            address, base = addresses[tensor], offsets[tensor] + start
            for i in range(cuda.threadIdx.x, count, cuda.blockDim.x):
                buffer[base + i] = _scaled_bfloat(load(address, start + i, buffer), scale)


@_kernel
def _unpack_bfloat_kernel(tasks, offsets, addresses, buffer, scale):
    for task in range(cuda.blockIdx.x, tasks.shape[0], cuda.gridDim.x):
        tensor, start, count = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        if tensor >= 0:
            address, base = addresses[tensor], offsets[tensor] + start
            for i in range(cuda.threadIdx.x, count, cuda.blockDim.x):
                store(address, start + i, _scaled_bfloat(buffer[base + i], scale), buffer)


def _reducer_16(to_bits: Callable, from_bits: Callable) -> Callable:
    def reduce(a, b, out, op):
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            x = np.uint32(from_bits(a[i])).view(np.float32)
            y = np.uint32(from_bits(b[i])).view(np.float32)
            if op == 0:
                out[i] = to_bits(np.float32(x + y).view(np.uint32))
            elif op == 3:
                out[i] = to_bits(np.float32(x * y).view(np.uint32))
            elif op == 1:
                out[i] = a[i] if (x <= y or x != x) else b[i]
            else:
                out[i] = a[i] if (x >= y or x != x) else b[i]

    return _kernel(reduce)


_encode_half, _encode_half_feedback = _encoder(_half_from_float, _float_from_half)
_encode_bfloat, _encode_bfloat_feedback = _encoder(_bfloat_from_float, _float_from_bfloat)
_decode_half = _decoder(_float_from_half)
_decode_bfloat = _decoder(_float_from_bfloat)
_reduce_half = _reducer_16(_half_from_float, _float_from_half)
_reduce_bfloat = _reducer_16(_bfloat_from_float, _float_from_bfloat)


@_kernel
def _reduce_native(a, b, out, op):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        x, y = widened(a[i]), widened(b[i])
        if op == 0:
            out[i] = x + y
        elif op == 3:
            out[i] = x * y
        elif op == 1:
            out[i] = x if (x <= y or x != x) else y
        else:
            out[i] = x if (x >= y or x != x) else y


@_kernel
def _scale_kernel(a, factor, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = widened(a[i]) * widened(factor)


@_kernel
def _divide_kernel(a, divisor, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = widened(a[i]) / widened(divisor)


@_kernel
def _scale_bfloat_kernel(a, factor, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = _scaled_bfloat(a[i], factor)


@_kernel
def _divide_bfloat_kernel(a, divisor, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        x = np.uint32(_float_from_bfloat(a[i])).view(np.float32)
        out[i] = _bfloat_from_float(np.float32(x / divisor).view(np.uint32))


@_kernel
def _abs_max_kernel(values, largest, nonfinite):
    # Any value already in ``largest`` is a lower bound of the answer, and has its type.
    local = largest[0]
    count = 0
    for i in range(cuda.grid(1), values.size, cuda.gridsize(1)):
        magnitude = abs(values[i])
        if magnitude != magnitude or magnitude == math.inf:
            count += 1
        elif magnitude > local:
            local = magnitude
    cuda.atomic.max(largest, 0, local)
    if count:
        cuda.atomic.add(nonfinite, 0, count)


class BfloatDeviceArray:
    """A bfloat16 array in device memory, C-contiguous: a uint16 device array of its bits
    (numba has no bfloat16 type) whose ``__cuda_array_interface__`` says ``bfloat16``.

    The collectives return these for bfloat16 results of device arrays other than torch
    tensors; ``bits`` is the numba array, ``copy_to_host()`` gives a bfloat16 numpy array.
    """

    dtype = BFLOAT16

    def __init__(self, bits: Any):
        self.bits = bits

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return tuple(self.bits.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Number of bytes."""
        return 2 * self.size

    @property
    def __cuda_array_interface__(self) -> dict:
        if SIMULATED:
            face = {"version": 3, "data": (_address(self.bits), False), "shape": self.shape,
                    "strides": None, "stream": None}
        else:
            face = dict(self.bits.__cuda_array_interface__)
        face["typestr"] = BFLOAT16_TYPESTR
        return face

    def __getitem__(self, key: Any) -> BfloatDeviceArray:
        return BfloatDeviceArray(self.bits[key])

    def reshape(self, *shape: Any) -> BfloatDeviceArray:
        """The same memory in another shape."""
        return BfloatDeviceArray(self.bits.reshape(*shape))

    def copy_to_host(self, ary: np.ndarray | None = None, stream: Any = 0) -> np.ndarray:
        """A bfloat16 numpy copy (into ``ary`` when given)."""
        if ary is None:
            return self.bits.copy_to_host(stream=stream).view(BFLOAT16)
        self.bits.copy_to_host(ary.view(np.uint16), stream=stream)
        return ary

    def copy_to_device(self, ary: np.ndarray, stream: Any = 0) -> None:
        """Overwrite this array with bfloat16 numpy array ``ary`` (same shape)."""
        self.bits.copy_to_device(np.ascontiguousarray(ary).view(np.uint16), stream=stream)

    def __repr__(self) -> str:
        return f"BfloatDeviceArray(shape={self.shape})"


def _storage(dtype: np.dtype) -> np.dtype:
    """What a new device array of ``dtype`` is made of: bfloat16 as its uint16 bits."""
    return np.dtype(np.uint16) if dtype == BFLOAT16 else dtype


def _typed(array: Any, dtype: np.dtype) -> Any:
    """A new device array made of :func:`_storage` ``(dtype)``, seen as ``dtype``."""
    return BfloatDeviceArray(array) if dtype == BFLOAT16 else array


class _BitsInterface:
    """bfloat16 device memory described as uint16, for numba."""

    def __init__(self, face: dict):
        self.__cuda_array_interface__ = dict(face, typestr=np.dtype(np.uint16).str)


def is_device_array(array: Any) -> bool:
    """True for arrays the GPU kernels take (device memory, or the simulator's arrays).

    Under the simulator, objects with ``__cuda_array_interface__`` count too: their
    memory is the simulated device's, which is host memory.
    """
    if SIMULATED and _is_simulator_array(array):
        return True
    return hasattr(array, "__cuda_array_interface__")


def _is_simulator_array(array: Any) -> bool:
    return isinstance(getattr(array, "_ary", None), np.ndarray)


def _interface(array: Any) -> dict:
    return array.__cuda_array_interface__


def _described(array: Any) -> Any:
    """Something with ``array``'s shape and numpy dtype, as its interface gives them (the
    array's own attributes may be missing, or not numpy's: torch's dtype, torch's size())."""
    if _is_simulator_array(array) if SIMULATED else cuda.devicearray.is_cuda_ndarray(array):
        return array
    face = _interface(array)
    return SimpleNamespace(shape=tuple(face["shape"]), dtype=np.dtype(face["typestr"]))


def _address(array: Any) -> int:
    if SIMULATED and _is_simulator_array(array):
        return array._ary.ctypes.data
    return _interface(array)["data"][0]


def address_of(array: Any) -> int:
    """The device address of ``array``'s first element."""
    return _address(array)


def _simulated_view(array: Any) -> Any:
    """A simulator array over the host memory that ``array``'s interface describes."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    face = _interface(array)
    dtype, shape = np.dtype(face["typestr"]), tuple(face["shape"])
    count = math.prod(shape)
    if count == 0:
        return FakeCUDAArray(np.empty(shape, dtype))
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(face["data"][0])
    return FakeCUDAArray(np.frombuffer(raw, dtype, count).reshape(shape))


def _check_contiguous(array: Any) -> None:
    if SIMULATED and _is_simulator_array(array):
        contiguous = array._ary.flags.c_contiguous
    else:
        face = _interface(array)
        strides = face.get("strides")
        contiguous = strides is None or strides == _c_strides(face["shape"], face["typestr"])
    if not contiguous:
        raise ValueError("kernels need C-contiguous arrays")


def _c_strides(shape: Sequence[int], typestr: str) -> tuple[int, ...]:
    stride, strides = np.dtype(typestr).itemsize, []
    for extent in reversed(shape):
        strides.append(stride)
        stride *= extent
    return tuple(reversed(strides))


def _array(array: Any) -> Any:
    """``array`` as a 1-D numba device array over the same memory (no copy, no sync);
    bfloat16 memory as its uint16 bits."""
    _check_contiguous(array)
    if isinstance(array, BfloatDeviceArray):
        kernel_array = array.bits
    elif SIMULATED:
        kernel_array = array if _is_simulator_array(array) else _simulated_view(array)
    elif not cuda.is_cuda_array(array):
        raise ValueError(f"not a device array: {type(array).__name__}")
    elif cuda.devicearray.is_cuda_ndarray(array):
        kernel_array = array
    else:
        face = _interface(array)
        if np.dtype(face["typestr"]) == BFLOAT16:
            array = _BitsInterface(face)
        kernel_array = cuda.as_cuda_array(array, sync=False)
    if kernel_array.dtype == BFLOAT16:  # the simulator's arrays over bfloat16 host memory
        kernel_array = kernel_array.view(np.uint16)
    return kernel_array.reshape(kernel_array.size) if kernel_array.ndim != 1 else kernel_array


@functools.cache
def _default_stream() -> Any:
    """numba's default stream (made once: the object names no context, and numba takes
    tens of microseconds to make one)."""
    return cuda.default_stream()


def _stream(array: Any) -> Any:
    """The stream that produced ``array``, as its interface names it, else the default."""
    if SIMULATED:
        return _default_stream()
    if cuda.devicearray.is_cuda_ndarray(array):
        return array.stream or _default_stream()
    handle = _interface(array).get("stream")
    if handle is None or handle == 1:
        return _default_stream()
    if handle == 2:
        return cuda.per_thread_default_stream()
    return cuda.external_stream(handle)


def _launch(kernel: Callable, size: int, stream: Any, *args) -> None:
    _prepared(kernel, size, stream, *args)()


def _prepared(kernel: Callable, size: int, stream: Any, *args) -> Callable[[], None]:
    """A function queuing ``kernel`` over ``size`` elements with ``args`` on ``stream``."""
    blocks = max(1, min(MAX_BLOCKS, -(-size // THREADS_PER_BLOCK)))
    configured = kernel[blocks, THREADS_PER_BLOCK, stream]
    return lambda: configured(*args)


def _tables(layout: FusionLayout, tensors: Sequence[Any], stream: Any) -> tuple:
    """The layout's task and offset tables on the device, and the tensors' addresses."""
    cache = layout.device_tables
    if "tasks" not in cache:
        cache["tasks"] = cuda.to_device(layout.tasks, stream=stream)
        cache["offsets"] = cuda.to_device(layout.offsets, stream=stream)
    for tensor in tensors:
        _check_contiguous(tensor)
    addresses = np.array([_address(t) for t in tensors] or [0], np.int64)
    if not np.array_equal(addresses, cache.get("addresses_host")):
        cache["addresses_host"] = addresses
        cache["addresses"] = cuda.to_device(addresses, stream=stream)
    return cache["tasks"], cache["offsets"], cache["addresses"]


def _check_fits(layout: FusionLayout, tensors: Sequence[Any], buffer: Any) -> None:
    layout.check([_described(t) for t in tensors], _described(buffer))


def pack(layout: FusionLayout, tensors: Sequence[Any], buffer: Any,
         scale: float = 1.0) -> None:
    """Device twin of :func:`ringtrain.kernels.host.pack`: one launch for all tensors."""
    _run_tasks((_pack_kernel, _pack_bfloat_kernel), layout, tensors, buffer, scale)


def unpack(layout: FusionLayout, buffer: Any, tensors: Sequence[Any],
           scale: float = 1.0) -> None:
    """Device twin of :func:`ringtrain.kernels.host.unpack`: one launch for all tensors."""
    _run_tasks((_unpack_kernel, _unpack_bfloat_kernel), layout, tensors, buffer, scale)


def _run_tasks(kernels: tuple[Callable, Callable], layout: FusionLayout,
               tensors: Sequence[Any], buffer: Any, scale: float) -> None:
    """Run the task kernel of ``kernels`` (plain, bfloat16 with a scale) for the layout."""
    _check_fits(layout, tensors, buffer)
    stream = _stream(buffer)
    flat = _array(buffer)
    tasks, offsets, addresses = _tables(layout, tensors, stream)
    if not len(layout.tasks):
        return
    blocks = len(layout.tasks) * THREADS_PER_BLOCK
    if layout.dtype != BFLOAT16:
        _launch(kernels[0], blocks, stream, tasks, offsets, addresses, flat,
                _scalar(scale, layout.dtype), scale != 1.0)
    elif scale == 1.0:  # the bits are copied as they are
        _launch(kernels[0], blocks, stream, tasks, offsets, addresses, flat, np.uint16(1),
                False)
    else:
        _launch(kernels[1], blocks, stream, tasks, offsets, addresses, flat,
                _float32_scale(scale))


def _scalar(value: float, dtype: np.dtype) -> Any:
    if dtype.kind != "f":
        if value != 1.0:
            raise ValueError(f"a scale needs a floating dtype, got {dtype}")
        return dtype.type(1)
    return dtype.type(value)


def _float32_scale(scale: float) -> np.float32:
    value = np.float32(scale)
    if not np.isfinite(value):
        raise ValueError(f"scale {scale} is not a finite float32")
    return value


def _bits(array: Any) -> Any:
    flat = _array(array)
    return flat if flat.dtype == np.uint16 else flat.view(np.uint16)


def _check_dtype(name: str, array: Any, dtype: Any) -> None:
    found = _described(array).dtype
    if found != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {found}")


def _check_sizes(first: Any, second: Any) -> None:
    if first.size != second.size:
        raise ValueError(f"sizes differ: {first.size} and {second.size}")


def encode_half(source: Any, wire: Any, scale: float = 1.0, residual: Any = None) -> None:
    """Device twin of :func:`ringtrain.kernels.host.encode_half`."""
    _encode_16(_encode_half, _encode_half_feedback, source, wire, scale, residual)


def encode_bfloat(source: Any, wire: Any, scale: float = 1.0, residual: Any = None) -> None:
    """Device twin of :func:`ringtrain.kernels.host.encode_bfloat`."""
    _encode_16(_encode_bfloat, _encode_bfloat_feedback, source, wire, scale, residual)


def _encode_16(plain: Callable, feedback: Callable, source: Any, wire: Any, scale: float,
               residual: Any) -> None:
    _check_dtype("source", source, np.float32)
    stream = _stream(source)
    flat, bits = _array(source), _bits(wire)
    _check_sizes(flat, bits)
    if residual is None:
        _launch(plain, flat.size, stream, flat, bits, _float32_scale(scale))
    else:
        _check_dtype("residual", residual, np.float32)
        kept = _array(residual)
        if kept.size != flat.size:
            raise ValueError(f"source has {flat.size} elements, residual {kept.size}")
        _launch(feedback, flat.size, stream, flat, bits, _float32_scale(scale), kept,
                _float32_scale(1.0 / scale))


def decode_half(wire: Any, out: Any, scale: float = 1.0) -> None:
    """Device twin of :func:`ringtrain.kernels.host.decode_half`."""
    _decode_16(_decode_half, wire, out, scale)


def decode_bfloat(wire: Any, out: Any, scale: float = 1.0) -> None:
    """Device twin of :func:`ringtrain.kernels.host.decode_bfloat`."""
    _decode_16(_decode_bfloat, wire, out, scale)


def _decode_16(kernel: Callable, wire: Any, out: Any, scale: float) -> None:
    _check_dtype("out", out, np.float32)
    stream = _stream(wire)
    bits, flat = _bits(wire), _array(out)
    _check_sizes(bits, flat)
    _launch(kernel, flat.size, stream, bits, flat, _float32_scale(scale))


@_kernel
def _quantize_2bit_kernel(gradient, residual, words, threshold):
    for word in range(cuda.grid(1), words.size, cuda.gridsize(1)):
        words[word] = _quantize_word(gradient, residual, word, threshold)


@_kernel
def _dequantize_2bit_kernel(words, out, threshold):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = _dequantized(words, i, threshold)


def quantize_2bit(gradient: Any, residual: Any, words: Any, threshold: float) -> None:
    """Device twin of :func:`ringtrain.kernels.host.quantize_2bit`: a thread per word."""
    flat, kept, coded = _array(gradient), _array(residual), _array(words)
    t = two_bit.checked_threshold(flat.size, _described(gradient).dtype, coded, kept,
                                  threshold)
    _launch(_quantize_2bit_kernel, coded.size, _stream(gradient), flat, kept, coded, t)


def dequantize_2bit(words: Any, out: Any, threshold: float) -> None:
    """Device twin of :func:`ringtrain.kernels.host.dequantize_2bit`."""
    flat, coded = _array(out), _array(words)
    t = two_bit.checked_threshold(flat.size, _described(out).dtype, coded, None, threshold)
    _launch(_dequantize_2bit_kernel, flat.size, _stream(out), coded, flat, t)


@_kernel
def _gather_kernel(source, indices, out):
    for j in range(cuda.grid(1), indices.size, cuda.gridsize(1)):
        out[j] = source[indices[j]]


@_kernel
def _zero_kernel(out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = 0


@_kernel
def _scatter_kernel(source, indices, out):
    for j in range(cuda.grid(1), indices.size, cuda.gridsize(1)):
        out[indices[j]] = source[j]


def gather_indexed(source: Any, indices: Any, out: Any) -> None:
    """Device twin of :func:`ringtrain.kernels.host.gather_indexed` (``indices`` a device
    array too)."""
    stream = _stream(source)
    whole, chosen, packed = _indexed_operands(source, indices, out)
    _launch(_gather_kernel, chosen.size, stream, whole, chosen, packed)


def scatter_indexed(source: Any, indices: Any, out: Any) -> None:
    """Device twin of :func:`ringtrain.kernels.host.scatter_indexed` (``indices`` a device
    array too)."""
    stream = _stream(out)
    whole, chosen, packed = _indexed_operands(out, indices, source)
    _launch(_zero_kernel, whole.size, stream, whole)
    _launch(_scatter_kernel, chosen.size, stream, packed, chosen, whole)


def _indexed_operands(whole: Any, indices: Any, packed: Any) -> tuple[Any, Any, Any]:
    """As the host twin's: the arrays as unsigned integers of their element size, the
    indices checked (their first and last copied to the host)."""
    whole_type, packed_type = _described(whole).dtype, _described(packed).dtype
    chosen = _array(indices)
    if packed_type != whole_type or _array(packed).size != chosen.size:
        raise ValueError(f"the packed array must hold {chosen.size} {whole_type}, got "
                         f"{_array(packed).size} {packed_type}")
    if chosen.dtype != np.int64:
        raise ValueError(f"indices must be 1-D int64, got {chosen.dtype}")
    unsigned = np.dtype(f"u{whole_type.itemsize}")
    flat_whole = _array(whole).view(unsigned)
    if chosen.size:
        ends = np.empty(2, np.int64)
        chosen[:1].copy_to_host(ends[:1])
        chosen[chosen.size - 1:].copy_to_host(ends[1:])
        if not (ends[0] >= 0 and ends[1] < flat_whole.size):
            raise ValueError(f"indices from {ends[0]} to {ends[1]} are outside "
                             f"{flat_whole.size} elements")
    return flat_whole, chosen, _array(packed).view(unsigned)


def _encoding(encoding: str | None, out: Any) -> str | None:
    """The format of ``out``'s elements: ``encoding`` if given, else its dtype's."""
    if encoding is None:
        return encoding_of(_described(out).dtype)
    if encoding != BFLOAT16_ENCODING:
        raise ValueError(f"unknown encoding {encoding!r}")
    return encoding


def reduce_into(op: str, a: Any, b: Any, out: Any, encoding: str | None = None) -> None:
    """Device twin of :func:`ringtrain.kernels.host.reduce_into`."""
    prepared_reduction(op, a, b, out, encoding)()


def prepared_reduction(op: str, a: Any, b: Any, out: Any,
                       encoding: str | None = None) -> Callable[[], None]:
    """:func:`reduce_into` checked and set up once: each call of the returned function
    queues the kernel on ``out``'s stream (launching one through numba costs tens of
    microseconds less than :func:`reduce_into` when the same arrays are reduced again)."""
    stream = _stream(out)
    code = OP_CODES[op]
    flat = _array(out)
    if _encoding(encoding, out) == BFLOAT16_ENCODING:
        kernel, dtype = _reduce_bfloat, np.dtype(np.uint16)
    elif flat.dtype == np.float16:
        kernel, dtype = _reduce_half, np.dtype(np.float16)
    else:
        kernel, dtype = _reduce_native, None
    operands = {"a": _array(a), "b": _array(b), "out": flat}
    for name, array in operands.items():
        if array.size != flat.size or (dtype is not None and array.dtype != dtype):
            raise ValueError(f"{name} must hold {flat.size} {dtype or flat.dtype}, got "
                             f"{array.size} {array.dtype}")
    if dtype is None:
        return _prepared(kernel, flat.size, stream, operands["a"], operands["b"], flat, code)
    return _prepared(kernel, flat.size, stream, _bits(a), _bits(b), _bits(out), code)


def scale_into(a: Any, factor: float, out: Any, encoding: str | None = None) -> None:
    """Device twin of :func:`ringtrain.kernels.host.scale_into`."""
    prepared_scaling(a, factor, out, encoding)()


def prepared_scaling(a: Any, factor: float, out: Any,
                     encoding: str | None = None) -> Callable[[], None]:
    """:func:`scale_into` checked and set up once (see :func:`prepared_reduction`)."""
    stream = _stream(out)
    flat_a, flat_out = _array(a), _array(out)
    if factor == 1.0:
        if _address(a) == _address(out):
            return _nothing
        return lambda: flat_out.copy_to_device(flat_a, stream=stream)
    if _encoding(encoding, out) == BFLOAT16_ENCODING:
        _check_sizes(flat_a, flat_out)
        return _prepared(_scale_bfloat_kernel, flat_out.size, stream, _bits(a),
                         _float32_scale(factor), _bits(out))
    return _prepared(_scale_kernel, flat_out.size, stream, flat_a,
                     _scalar(factor, flat_out.dtype), flat_out)


def divide_into(a: Any, divisor: int, out: Any, encoding: str | None = None) -> None:
    """Device twin of :func:`ringtrain.kernels.host.divide_into`."""
    prepared_division(a, divisor, out, encoding)()


def prepared_division(a: Any, divisor: int, out: Any,
                      encoding: str | None = None) -> Callable[[], None]:
    """:func:`divide_into` checked and set up once (see :func:`prepared_reduction`)."""
    flat_a, flat_out = _array(a), _array(out)
    _check_sizes(flat_a, flat_out)
    if _encoding(encoding, out) == BFLOAT16_ENCODING:
        return _prepared(_divide_bfloat_kernel, flat_out.size, _stream(out), _bits(a),
                         np.float32(divisor), _bits(out))
    return _prepared(_divide_kernel, flat_out.size, _stream(out), flat_a,
                     _scalar(float(divisor), flat_out.dtype), flat_out)


def _nothing() -> None:
    pass


def abs_max(values: Any) -> tuple[float, bool]:
    """Device twin of :func:`ringtrain.kernels.host.abs_max` (waits for the result)."""
    dtype = _described(values).dtype
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"abs_max needs float32 or float64, got {dtype}")
    flat = _array(values)
    if flat.size == 0:
        return 0.0, False
    stream = _stream(values)
    largest = cuda.to_device(np.zeros(1, dtype), stream=stream)
    nonfinite = cuda.to_device(np.zeros(1, np.int64), stream=stream)
    _launch(_abs_max_kernel, flat.size, stream, flat, largest, nonfinite)
    found = largest.copy_to_host(stream=stream)
    count = nonfinite.copy_to_host(stream=stream)
    stream.synchronize()
    return float(found[0]), bool(count[0])


def copy_to_host(device_buffer: Any, host_buffer: np.ndarray) -> None:
    """Copy a device buffer into a host buffer; returns once the copy is done."""
    stream = _stream(device_buffer)
    _array(device_buffer).copy_to_host(host_buffer, stream=stream)
    stream.synchronize()


def copy_to_device(host_buffer: np.ndarray, device_buffer: Any) -> None:
    """Copy a host buffer into a device buffer, ordered before later work on its stream."""
    _array(device_buffer).copy_to_device(host_buffer, stream=_stream(device_buffer))


def copy_bytes(target: int, source: int, nbytes: int) -> None:
    """Queue a copy of ``nbytes`` bytes from device address ``source`` to device address
    ``target`` (either may be another process's memory mapped here) on the default
    stream: one driver call, without the checks of a copy between array objects."""
    if nbytes <= 0:
        return
    if SIMULATED:
        ctypes.memmove(target, source, nbytes)
        return
    from numba.cuda.cudadrv.driver import driver
    driver.cuMemcpyDtoDAsync(target, source, nbytes, 0)


def synchronize_default() -> None:
    """Wait until the work queued on the default stream is done."""
    _default_stream().synchronize()


def synchronize(array: Any) -> None:
    """Wait until the work queued on ``array``'s stream is done."""
    _stream(array).synchronize()


def empty_like(array: Any, dtype: Any) -> Any:
    """A new uninitialised device array of ``array``'s shape and the given dtype."""
    dtype = np.dtype(dtype)
    return _typed(cuda.device_array(tuple(_described(array).shape), _storage(dtype),
                                    stream=_stream(array)), dtype)


def zeros(like: Any, shape: Sequence[int], dtype: Any) -> Any:
    """A new zeroed device array of ``shape`` and ``dtype``, on ``like``'s stream (the
    default stream when ``like`` is None); ready when this returns."""
    dtype = np.dtype(dtype)
    stream = _default_stream() if like is None else _stream(like)
    array = cuda.to_device(np.zeros(tuple(shape), _storage(dtype)), stream=stream)
    stream.synchronize()
    return _typed(array, dtype)


def zeros_like(array: Any) -> Any:
    """A new zeroed device array of ``array``'s shape and dtype."""
    described = _described(array)
    dtype = np.dtype(described.dtype)
    return _typed(cuda.to_device(np.zeros(tuple(described.shape), _storage(dtype)),
                                 stream=_stream(array)), dtype)


def dtype_of(array: Any) -> np.dtype:
    """``array``'s numpy dtype, as its ``__cuda_array_interface__`` gives it (torch's own
    dtype is not numpy's)."""
    return _described(array).dtype


def nbytes_of(array: Any) -> int:
    """The bytes of C-contiguous device ``array``, read from its interface (making no
    device array, which costs numba tens of microseconds)."""
    _check_contiguous(array)
    described = _described(array)
    return math.prod(described.shape) * described.dtype.itemsize


def byte_view(array: Any) -> Any:
    """``array`` as a 1-D device array of bytes over the same memory (no copy)."""
    flat = _array(array)
    return flat if flat.dtype == np.uint8 else flat.view(np.uint8)


def view_as(byte_array: Any, dtype: Any) -> Any:
    """1-D device byte array ``byte_array`` seen as elements of ``dtype`` (no copy; a
    bfloat16 view is a :class:`BfloatDeviceArray`)."""
    dtype = np.dtype(dtype)
    return _typed(_array(byte_array).view(_storage(dtype)), dtype)


def empty(shape: Sequence[int], dtype: Any) -> Any:
    """A new uninitialised device array on the current device."""
    dtype = np.dtype(dtype)
    return _typed(cuda.device_array(tuple(shape), _storage(dtype)), dtype)


def pinned_bytes(nbytes: int) -> np.ndarray:
    """A page-locked host buffer of ``nbytes`` bytes: the GPU copies to and from it by DMA,
    asynchronously and at full link speed."""
    return cuda.pinned_array(nbytes, np.uint8)


def wait_for_producer(array: Any) -> None:
    """Wait until the work that produced ``array`` is done: the stream its interface names,
    or, when it names none, everything queued on the device."""
    if SIMULATED:
        return
    if cuda.devicearray.is_cuda_ndarray(array):
        (array.stream or _default_stream()).synchronize()
    elif _interface(array).get("stream") is None:
        cuda.synchronize()
    else:
        _stream(array).synchronize()


def ipc_supported() -> bool:
    """Whether this platform's CUDA driver can share device memory between processes."""
    from numba.cuda.cudadrv import driver
    return bool(driver.SUPPORTS_IPC)


def current_context() -> Any:
    """numba's CUDA context of the calling thread's current device."""
    return cuda.current_context()


def simulated_array(values: np.ndarray) -> Any:
    """Under the simulator: a device array over host array ``values`` (no copy)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray(values)


def current_device() -> int:
    """The ordinal of the calling thread's current device."""
    return 0 if SIMULATED else cuda.get_current_device().id


def on_device(ordinal: int) -> Any:
    """A context manager making device ``ordinal`` current on the calling thread."""
    return contextlib.nullcontext() if SIMULATED else cuda.gpus[ordinal]


class CopyEngine:
    """Asynchronous copies between device memory and pinned host memory, one stream per
    direction, so that both directions and the host's work overlap.

    Copies in one direction run in the order they were queued. Make one per device.
    """

    def __init__(self) -> None:
        self._down = cuda.stream()
        self._up = cuda.stream()

    def to_host(self, device_bytes: Any, host_bytes: np.ndarray) -> Any:
        """Queue a device-to-host copy; returns an event to ``synchronize()`` on."""
        device_bytes.copy_to_host(host_bytes, stream=self._down)
        done = cuda.event()
        done.record(self._down)
        return done

    def to_device(self, host_bytes: np.ndarray, device_bytes: Any) -> Any:
        """Queue a host-to-device copy; returns an event to ``synchronize()`` on before
        the host buffer is written again."""
        device_bytes.copy_to_device(host_bytes, stream=self._up)
        done = cuda.event()
        done.record(self._up)
        return done

    def finish(self) -> None:
        """Wait for every queued copy."""
        self._down.synchronize()
        self._up.synchronize()
