"""Kernels benchmark: ringtrain's array kernels against a memory copy and numpy's way.

    python benchmarks/kernels.py                        # host twins: 1, 16 and 256 MiB
    python benchmarks/kernels.py --sizes 1,16 --repeats 9
    python benchmarks/kernels.py --device               # device twins, on a CUDA GPU

Sizes are of float32 source data (the 16-bit rows cast or add as many elements). GB/s
counts the bytes an operation reads plus the bytes it writes (GB = 1e9 bytes); a time is
the median over --repeats rounds of the mean per-call time, after a warm-up call (the JIT),
with ringtrain, the copy and the baseline measured in turn within each round, so machine
noise hits all alike. ``xcopy`` is GB/s over the copy ceiling's: a plain copy moving the
same bytes (``np.copyto``; on the GPU a device-to-device copy). ``xbase`` is GB/s over the
obvious way without ringtrain: numpy's ``astype``, ``np.add`` (for bfloat16 arrays, the
``ml_dtypes`` ufunc) and a loop of slice assignments for pack and unpack (the bfloat16
casts, which numpy lacks, by integer ufuncs); on the GPU, CuPy's where CuPy imports ("-"
where there is no baseline).

pack and unpack move a set of 64 tensors of varied sizes (a few large, many small, as in a
model) summing to the size, into and out of a fusion buffer; ``x0.5`` fuses a scale.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

MIB = 1 << 20
TENSORS = 64


@dataclass
class Case:
    """One row: ringtrain's call, its baseline, and the bytes a call reads plus writes."""

    name: str
    nbytes: int
    ours: Callable[[], Any]
    baseline: Callable[[], Any] | None


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16,256",
                        help="comma-separated sizes of float32 source data, in MiB")
    parser.add_argument("-r", "--repeats", type=int, default=7,
                        help="timed rounds per row; the median is reported")
    parser.add_argument("--round-bytes", type=float, default=256,
                        help="MiB moved per call kind per round (sets the calls per round)")
    parser.add_argument("--device", action="store_true",
                        help="run the device twins on a CUDA GPU (numba device arrays)")
    parser.add_argument("--only", default=None,
                        help="comma-separated row names (or prefixes) to run, e.g. pack,encode")
    arguments = parser.parse_args(argv)
    try:
        arguments.sizes = [float(size) for size in arguments.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes MiB numbers, got {arguments.sizes!r}")
    if arguments.repeats < 1 or any(size <= 0 for size in arguments.sizes):
        parser.error("--repeats and --sizes must be positive")
    return arguments


def tensor_sizes(elements: int, count: int = TENSORS, seed: int = 0) -> list[int]:
    """``count`` sizes summing to ``elements``: log-normal weights, so a few large tensors
    hold most of the data and many hold little (biases, norms), in a shuffled order."""
    count = max(1, min(count, elements))
    weights = np.random.default_rng(seed).lognormal(0.0, 2.0, count)
    sizes = np.maximum(1, np.floor(weights / weights.sum() * elements)).astype(np.int64)
    sizes[np.argmax(sizes)] += elements - int(sizes.sum())
    return [int(size) for size in sizes]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_lines(device: bool) -> list[str]:
    """What the numbers were measured on."""
    import numba

    from ringtrain import kernels
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count()
    lines = [f"# {cpu_model()}, {cores} cores usable, python {platform.python_version()}, "
             f"numpy {np.__version__}, numba {numba.__version__}, "
             f"host kernel threads {kernels.host_threads()}"]
    if device:
        from numba import cuda
        gpu = cuda.get_current_device()
        cupy = _cupy()
        lines.append(f"# GPU {gpu.name.decode() if isinstance(gpu.name, bytes) else gpu.name}"
                     f" (compute capability {'.'.join(map(str, gpu.compute_capability))}), "
                     f"CuPy {cupy.__version__ if cupy else 'not importable'}")
    return lines


def _cupy() -> Any:
    try:
        import cupy
    except Exception:
        return None
    return cupy


# ----------------------------------------------------------------------------- host


def host_cases(elements: int) -> list[tuple[str, Callable[[], Case]]]:
    """The rows on numpy arrays, each built when it runs (so only its arrays are alive)."""
    from ringtrain import kernels
    rng = np.random.default_rng(1)

    def source32() -> np.ndarray:
        return rng.standard_normal(elements, dtype=np.float32)

    def pack(scale: float) -> Case:
        tensors = [rng.standard_normal(n, dtype=np.float32) for n in tensor_sizes(elements)]
        layout = kernels.FusionLayout.of(tensors)
        buffer, plain = layout.empty_buffer(), layout.empty_buffer()
        places = list(zip(layout.offsets.tolist(), layout.sizes.tolist(), tensors))

        def numpy_way() -> None:
            for offset, size, tensor in places:
                if scale == 1.0:
                    plain[offset:offset + size] = tensor
                else:
                    np.multiply(tensor, scale, out=plain[offset:offset + size])
            for start, stop in layout.padding:
                plain[start:stop] = 0

        return Case(f"pack{' x' + str(scale) if scale != 1 else ''}",
                    4 * (elements + layout.total_size),
                    lambda: kernels.pack(layout, tensors, buffer, scale), numpy_way)

    def unpack(scale: float) -> Case:
        tensors = [np.zeros(n, np.float32) for n in tensor_sizes(elements)]
        plain = [np.zeros(n, np.float32) for n in tensor_sizes(elements)]
        layout = kernels.FusionLayout.of(tensors)
        buffer = layout.empty_buffer()
        buffer[:] = rng.standard_normal(buffer.size, dtype=np.float32)
        places = list(zip(layout.offsets.tolist(), layout.sizes.tolist(), plain))

        def numpy_way() -> None:
            for offset, size, tensor in places:
                if scale == 1.0:
                    tensor[:] = buffer[offset:offset + size]
                else:
                    np.multiply(buffer[offset:offset + size], scale, out=tensor)

        return Case(f"unpack{' x' + str(scale) if scale != 1 else ''}", 8 * elements,
                    lambda: kernels.unpack(layout, buffer, tensors, scale), numpy_way)

    def encode_half() -> Case:
        source, wire = source32(), np.zeros(elements, np.float16)
        return Case("encode fp16", 6 * elements, lambda: kernels.encode_half(source, wire),
                    lambda: source.astype(np.float16))

    def decode_half() -> Case:
        wire, out = source32().astype(np.float16), np.zeros(elements, np.float32)
        return Case("decode fp16", 6 * elements, lambda: kernels.decode_half(wire, out),
                    lambda: wire.astype(np.float32))

    def encode_bfloat() -> Case:
        source, wire, plain = source32(), np.zeros(elements, np.uint16), \
            np.zeros(elements, np.uint16)
        bits = source.view(np.uint32)

        def numpy_way() -> None:  # round to nearest even; NaNs not kept NaN
            plain[:] = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16

        return Case("encode bf16", 6 * elements, lambda: kernels.encode_bfloat(source, wire),
                    numpy_way)

    def decode_bfloat() -> Case:
        wire = (source32().view(np.uint32) >> 16).astype(np.uint16)
        out, plain = np.zeros(elements, np.float32), np.zeros(elements, np.float32)
        plain_bits = plain.view(np.uint32)
        return Case("decode bf16", 6 * elements, lambda: kernels.decode_bfloat(wire, out),
                    lambda: np.left_shift(wire, 16, out=plain_bits, dtype=np.uint32))

    def add(dtype: Any) -> Case:
        a, b = source32().astype(dtype), source32().astype(dtype)
        out, plain = np.zeros(elements, dtype), np.zeros(elements, dtype)
        width = np.dtype(dtype).itemsize
        return Case(f"add {np.dtype(dtype).name}", 3 * width * elements,
                    lambda: kernels.reduce_into("sum", a, b, out),
                    lambda: np.add(a, b, out=plain))

    return [("pack", lambda: pack(1.0)), ("pack x0.5", lambda: pack(0.5)),
            ("unpack", lambda: unpack(1.0)), ("unpack x0.5", lambda: unpack(0.5)),
            ("encode fp16", encode_half), ("decode fp16", decode_half),
            ("encode bf16", encode_bfloat), ("decode bf16", decode_bfloat),
            ("add float32", lambda: add(np.float32)), ("add float16", lambda: add(np.float16)),
            ("add bfloat16", lambda: add(kernels.BFLOAT16))]


def host_copy(nbytes: int) -> Callable[[], Any]:
    """A copy that reads and writes ``nbytes`` in all."""
    source = np.ones(max(1, nbytes // 2), np.uint8)
    target = np.zeros_like(source)
    return lambda: np.copyto(target, source)


# ----------------------------------------------------------------------------- device


def device_cases(elements: int) -> list[tuple[str, Callable[[], Case]]]:
    """The rows on numba device arrays; baselines on CuPy arrays where CuPy imports."""
    from numba import cuda

    from ringtrain import kernels
    cupy = _cupy()
    rng = np.random.default_rng(1)

    def source32() -> np.ndarray:
        return rng.standard_normal(elements, dtype=np.float32)

    def pack(scale: float) -> Case:
        host_tensors = [rng.standard_normal(n, dtype=np.float32)
                        for n in tensor_sizes(elements)]
        layout = kernels.FusionLayout.of(host_tensors)
        tensors = [cuda.to_device(t) for t in host_tensors]
        buffer = cuda.to_device(layout.empty_buffer())
        baseline = None
        if cupy is not None:
            plain, plain_tensors = cupy.zeros(layout.total_size, cupy.float32), \
                [cupy.asarray(t) for t in host_tensors]
            places = list(zip(layout.offsets.tolist(), layout.sizes.tolist(), plain_tensors))

            def run_cupy() -> None:
                for offset, size, tensor in places:
                    if scale == 1.0:
                        plain[offset:offset + size] = tensor
                    else:
                        cupy.multiply(tensor, scale, out=plain[offset:offset + size])
                for start, stop in layout.padding:
                    plain[start:stop] = 0

            baseline = run_cupy
        return Case(f"pack{' x' + str(scale) if scale != 1 else ''}",
                    4 * (elements + layout.total_size),
                    lambda: kernels.pack(layout, tensors, buffer, scale), baseline)

    def unpack(scale: float) -> Case:
        sizes = tensor_sizes(elements)
        tensors = [cuda.to_device(np.zeros(n, np.float32)) for n in sizes]
        layout = kernels.FusionLayout([(n,) for n in sizes], np.float32)
        host_buffer = rng.standard_normal(layout.total_size, dtype=np.float32)
        buffer = cuda.to_device(host_buffer)
        baseline = None
        if cupy is not None:
            plain_buffer = cupy.asarray(host_buffer)
            places = list(zip(layout.offsets.tolist(), layout.sizes.tolist(),
                              [cupy.zeros(n, cupy.float32) for n in sizes]))

            def run_cupy() -> None:
                for offset, size, tensor in places:
                    if scale == 1.0:
                        tensor[:] = plain_buffer[offset:offset + size]
                    else:
                        cupy.multiply(plain_buffer[offset:offset + size], scale, out=tensor)

            baseline = run_cupy
        return Case(f"unpack{' x' + str(scale) if scale != 1 else ''}", 8 * elements,
                    lambda: kernels.unpack(layout, buffer, tensors, scale), baseline)

    def cast(name: str, run: Callable, source: np.ndarray, wire_dtype: Any,
             cupy_way: Callable | None) -> Case:
        device_source = cuda.to_device(source)
        target = cuda.to_device(np.zeros(elements, wire_dtype))
        baseline = None
        if cupy is not None and cupy_way is not None:
            plain_source = cupy.asarray(source)

            def run_cupy() -> None:
                cupy_way(plain_source)

            baseline = run_cupy
        return Case(name, (source.dtype.itemsize + np.dtype(wire_dtype).itemsize) * elements,
                    lambda: run(device_source, target), baseline)

    def add(dtype: Any) -> Case:
        a, b = source32().astype(dtype), source32().astype(dtype)
        device_a, device_b = cuda.to_device(a), cuda.to_device(b)
        out = cuda.to_device(np.zeros(elements, dtype))
        baseline = None
        if cupy is not None:
            plain_a, plain_b, plain = cupy.asarray(a), cupy.asarray(b), \
                cupy.zeros(elements, dtype)

            def run_cupy() -> None:
                cupy.add(plain_a, plain_b, out=plain)

            baseline = run_cupy
        return Case(f"add {np.dtype(dtype).name}", 3 * np.dtype(dtype).itemsize * elements,
                    lambda: kernels.reduce_into("sum", device_a, device_b, out), baseline)

    return [
        ("pack", lambda: pack(1.0)), ("pack x0.5", lambda: pack(0.5)),
        ("unpack", lambda: unpack(1.0)), ("unpack x0.5", lambda: unpack(0.5)),
        ("encode fp16", lambda: cast("encode fp16", kernels.encode_half, source32(),
                                     np.float16, lambda s: s.astype(cupy.float16))),
        ("decode fp16", lambda: cast("decode fp16", kernels.decode_half,
                                     source32().astype(np.float16), np.float32,
                                     lambda s: s.astype(cupy.float32))),
        ("encode bf16", lambda: cast("encode bf16", kernels.encode_bfloat, source32(),
                                     np.uint16, None)),
        ("decode bf16", lambda: cast("decode bf16", kernels.decode_bfloat,
                                     (source32().view(np.uint32) >> 16).astype(np.uint16),
                                     np.float32, None)),
        ("add float32", lambda: add(np.float32)), ("add float16", lambda: add(np.float16)),
    ]


def device_copy(nbytes: int) -> Callable[[], Any]:
    """A device-to-device copy that reads and writes ``nbytes`` in all."""
    from numba import cuda
    source = cuda.to_device(np.ones(max(1, nbytes // 2), np.uint8))
    target = cuda.device_array_like(source)
    return lambda: target.copy_to_device(source)


# ----------------------------------------------------------------------------- timing


def measure(calls: dict[str, Callable[[], Any]], iterations: int, repeats: int,
            synchronize: Callable[[], None]) -> dict[str, float]:
    """Median over ``repeats`` rounds of the mean seconds per call, the calls in turn."""
    for call in calls.values():
        call()  # warm-up: JIT, first touch of the pages, caches of tables
    synchronize()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            synchronize()
            start = time.perf_counter()
            for _ in range(iterations):
                call()
            synchronize()
            times[name].append((time.perf_counter() - start) / iterations)
    return {name: statistics.median(values) for name, values in times.items()}


def selected(name: str, only: str | None) -> bool:
    return only is None or any(name.startswith(prefix.strip()) for prefix in only.split(","))


def main(argv: list[str]) -> int:
    """Measure and print the table."""
    arguments = parse_arguments(argv)
    synchronize: Callable[[], None] = lambda: None  # noqa: E731
    if arguments.device:
        from numba import cuda
        if "simulator" in cuda.to_device.__module__:
            sys.exit("--device measures a GPU; unset NUMBA_ENABLE_CUDASIM to run it")
        if not cuda.is_available():
            sys.exit("--device needs a CUDA GPU, and numba finds none "
                     "(numba.cuda.is_available() is False)")
        synchronize = cuda.synchronize
    cases, copy = (device_cases, device_copy) if arguments.device else (host_cases, host_copy)
    for line in machine_lines(arguments.device):
        print(line)
    baseline = "CuPy" if arguments.device else "numpy"
    print(f"# {'device' if arguments.device else 'host'} twins; median of {arguments.repeats} "
          f"rounds; GB/s = (bytes read + written) / time, 1 GB = 1e9 B; xcopy vs a copy of "
          f"the same bytes, xbase vs {baseline}")
    print(f"{'operation':<12} {'MiB':>6} {'MB/call':>9} {'us/call':>10} {'GB/s':>7} "
          f"{'copy GB/s':>9} {'xcopy':>6} {'base GB/s':>9} {'xbase':>6}", flush=True)
    for size in arguments.sizes:
        elements = max(1, int(size * MIB) // 4)
        for name, build in cases(elements):
            if not selected(name, arguments.only):
                continue
            case = build()
            calls = {"ours": case.ours, "copy": copy(case.nbytes)}
            if case.baseline is not None:
                calls["base"] = case.baseline
            iterations = max(1, min(1000, int(arguments.round_bytes * MIB) // case.nbytes))
            seconds = measure(calls, iterations, arguments.repeats, synchronize)
            rate = {key: case.nbytes / value / 1e9 for key, value in seconds.items()}
            base = (f"{rate['base']:>9.2f} {rate['ours'] / rate['base']:>6.2f}"
                    if "base" in rate else f"{'-':>9} {'-':>6}")
            print(f"{name:<12} {size:>6g} {case.nbytes / 1e6:>9.2f} "
                  f"{seconds['ours'] * 1e6:>10.1f} {rate['ours']:>7.2f} {rate['copy']:>9.2f} "
                  f"{rate['ours'] / rate['copy']:>6.2f} {base}", flush=True)
            del case, calls
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
