"""Where the device kernels' tests run: numba's CUDA simulator, a real GPU, or nowhere.

``NUMBA_ENABLE_CUDASIM=1`` runs the kernels' Python source on the CPU; numba reads it when
it is first imported, so these tests run in a pytest process of their own
(tests/test_device_kernels_sim.py starts one). Without it they need a CUDA GPU and skip
when there is none, unless ``RINGTRAIN_TEST_GPU=1`` asks for a real GPU: then every test
fails where none is found, the simulator included.
"""

from __future__ import annotations

import os

import pytest

GPU_REQUIRED = os.environ.get("RINGTRAIN_TEST_GPU") == "1"


def _find_mode() -> tuple[str | None, str]:
    """``("simulator" | "gpu" | None, description)``."""
    try:
        from numba import cuda
    except ImportError as error:
        return None, f"numba.cuda cannot be imported ({error}); install numba-cuda"
    if "simulator" in cuda.to_device.__module__:
        return "simulator", "numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
    try:
        available = cuda.is_available()
    except Exception as error:  # a broken driver install reads as no GPU
        return None, f"no usable CUDA GPU ({type(error).__name__}: {error})"
    if not available:
        return None, ("no CUDA GPU; NUMBA_ENABLE_CUDASIM=1 runs these tests under numba's "
                      "CUDA simulator")
    name = cuda.get_current_device().name
    return "gpu", f"GPU {name.decode() if isinstance(name, bytes) else name}"


MODE, DESCRIPTION = _find_mode()


def pytest_report_header(config):
    return f"device kernels: {DESCRIPTION}" + \
        ("; RINGTRAIN_TEST_GPU=1 requires a real GPU" if GPU_REQUIRED else "")


@pytest.fixture(autouse=True)
def device_mode() -> str:
    """``"simulator"`` or ``"gpu"``; skips the test where neither is there."""
    if GPU_REQUIRED and MODE != "gpu":
        pytest.fail(f"RINGTRAIN_TEST_GPU=1 requires a real CUDA GPU, but found {DESCRIPTION}",
                    pytrace=False)
    if MODE is None:
        pytest.skip(DESCRIPTION)
    return MODE


@pytest.fixture
def cuda(device_mode):
    """The ``numba.cuda`` module."""
    from numba import cuda
    return cuda


@pytest.fixture
def device(device_mode):
    """The device twins' module, ``ringtrain.kernels.device``."""
    from ringtrain.kernels import device
    return device
