"""Which GPU a rank uses: by local rank, unless there is nothing to choose or the user chose.

A fake ``libcuda`` stands in for the driver: its functions take the same ctypes arguments
as the real ones (written through ``byref``) and return a ``CUresult``, so the
:class:`Driver` wrapper is exercised as it is with the real library.
"""

import ctypes
import sys
import types

import pytest

from ringtrain.collectives import gpu_choice
from ringtrain.collectives.gpu_choice import GPU_CHOICE_VARIABLE, Driver, GpuChoice, choose_gpu

CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_CONTEXT = 201


class _Entry:
    """One driver function: records its calls; may be told to fail."""

    def __init__(self, library, name, body):
        self.library, self.name, self.body = library, name, body

    def __call__(self, *args):
        self.library.calls.append(self.name)
        failure = self.library.failures.get(self.name)
        if failure:
            return failure
        self.body(*args)
        return 0


class FakeLibcuda:
    """A driver with ``count`` devices; ``current`` is the device whose primary context
    is current on the (one) thread, or None."""

    def __init__(self, count, current=None, failures=None):
        self.count, self.current = count, current
        self.failures = dict(failures or {})
        self.calls = []
        self.retained = []
        self.cuInit = _Entry(self, "cuInit", lambda flags: None)
        self.cuDeviceGetCount = _Entry(self, "cuDeviceGetCount", self._count)
        self.cuCtxGetCurrent = _Entry(self, "cuCtxGetCurrent", self._get_current)
        self.cuCtxGetDevice = _Entry(self, "cuCtxGetDevice", self._get_device)
        self.cuDeviceGet = _Entry(self, "cuDeviceGet", self._device_get)
        self.cuDevicePrimaryCtxRetain = _Entry(self, "cuDevicePrimaryCtxRetain", self._retain)
        self.cuCtxSetCurrent = _Entry(self, "cuCtxSetCurrent", self._set_current)

    # Contexts are handles 0x1000 + device.
    def _count(self, count):
        count._obj.value = self.count

    def _get_current(self, context):
        context._obj.value = None if self.current is None else 0x1000 + self.current

    def _get_device(self, device):
        device._obj.value = self.current

    def _device_get(self, device, ordinal):
        assert 0 <= ordinal < self.count
        device._obj.value = ordinal

    def _retain(self, context, device):
        self.retained.append(device.value)
        context._obj.value = 0x1000 + device.value

    def _set_current(self, context):
        self.current = context.value - 0x1000


def driver_of(library):
    driver = Driver(library)
    driver.init()
    return driver


@pytest.mark.parametrize("local_rank, count, device", [(0, 2, 0), (1, 2, 1), (3, 4, 3),
                                                       (5, 4, 1), (2, 2, 0)])
def test_each_rank_uses_the_device_at_its_local_rank(local_rank, count, device):
    library = FakeLibcuda(count)
    choice = choose_gpu(local_rank, {}, driver_of(library))
    assert choice == GpuChoice(device, f"by local rank {local_rank}", count)
    assert str(choice) == f"device {device} of {count} (by local rank {local_rank})"
    assert library.current == device and library.retained == [device]


def test_a_context_already_current_is_left_alone():
    library = FakeLibcuda(4, current=2)
    choice = choose_gpu(1, {}, driver_of(library))
    assert str(choice) == "device 2 (already current before init)"
    assert library.current == 2 and library.retained == []
    assert "cuCtxSetCurrent" not in library.calls


@pytest.mark.parametrize("count, text", [(1, "none (1 device visible)"),
                                         (0, "none (0 devices visible)")])
def test_with_fewer_than_two_devices_there_is_nothing_to_choose(count, text):
    library = FakeLibcuda(count)
    choice = choose_gpu(3, {}, driver_of(library))
    assert choice.device is None and str(choice) == text
    assert library.calls == ["cuInit", "cuDeviceGetCount"]


@pytest.mark.parametrize("value", ["0", "no", " False "])
def test_the_variable_turns_the_choice_off(value):
    library = FakeLibcuda(4)
    choice = choose_gpu(1, {GPU_CHOICE_VARIABLE: value}, driver_of(library))
    assert str(choice) == f"none (turned off by {GPU_CHOICE_VARIABLE}={value.strip()})"
    assert library.calls == ["cuInit"]


@pytest.mark.parametrize("value", ["1", "yes", "TRUE", ""])
def test_the_variable_set_to_yes_chooses(value):
    choice = choose_gpu(1, {GPU_CHOICE_VARIABLE: value}, driver_of(FakeLibcuda(2)))
    assert choice.device == 1


def test_a_malformed_variable_is_refused_with_its_value_before_anything_is_done():
    library = FakeLibcuda(4)
    with pytest.raises(ValueError, match=f"{GPU_CHOICE_VARIABLE}='maybe'"):
        choose_gpu(1, {GPU_CHOICE_VARIABLE: "maybe"}, driver_of(library))
    assert library.calls == ["cuInit"]


@pytest.mark.parametrize("call", ["cuDeviceGetCount", "cuCtxGetCurrent", "cuDeviceGet",
                                  "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"])
def test_a_failing_driver_call_is_named_not_raised(call):
    library = FakeLibcuda(4, failures={call: CUDA_ERROR_INVALID_CONTEXT})
    choice = choose_gpu(1, {}, driver_of(library))
    assert choice.device is None
    assert str(choice) == f"none ({call} failed with CUDA error {CUDA_ERROR_INVALID_CONTEXT})"
    assert library.calls[-1] == call


def test_a_failing_context_query_is_named():
    library = FakeLibcuda(4, current=0, failures={"cuCtxGetDevice": 999})
    assert str(choose_gpu(1, {}, driver_of(library))) == \
        "none (cuCtxGetDevice failed with CUDA error 999)"


def test_a_failing_cu_init_means_no_driver(monkeypatch):
    library = FakeLibcuda(4, failures={"cuInit": CUDA_ERROR_NO_DEVICE})
    monkeypatch.setattr(gpu_choice.ctypes, "CDLL", lambda name: library)
    assert Driver.load() is None
    assert str(choose_gpu(1, {})) == f"none (cuInit failed with CUDA error {CUDA_ERROR_NO_DEVICE})"
    assert library.calls == ["cuInit", "cuInit"]


def test_the_loaded_driver_is_initialized(monkeypatch):
    library = FakeLibcuda(2)
    monkeypatch.setattr(gpu_choice.ctypes, "CDLL", lambda name: library)
    assert str(choose_gpu(1, {})) == "device 1 of 2 (by local rank 1)"
    assert library.calls[0] == "cuInit"


def test_no_driver_library_means_nothing_to_choose():
    assert Driver.load("libcuda-that-does-not-exist.so.1") is None


def test_on_this_machine_without_libcuda_nothing_is_chosen():
    try:
        ctypes.CDLL(gpu_choice.LIBCUDA)
    except OSError:
        pass
    else:
        pytest.skip("this machine has a CUDA driver")
    choice = choose_gpu(0)
    assert choice == GpuChoice(None, "no CUDA driver")
    assert str(choice) == "none (no CUDA driver)"


def _fake_torch(initialized, device=0):
    cuda = types.SimpleNamespace(is_initialized=lambda: initialized,
                                 current_device=lambda: device)
    return types.SimpleNamespace(cuda=cuda)


def test_torch_initialized_before_init_keeps_its_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(True, device=3))
    library = FakeLibcuda(4)
    choice = choose_gpu(1, {}, driver_of(library))
    assert str(choice) == "device 3 (torch's CUDA initialized before init)"
    assert library.calls == ["cuInit"]


def test_torch_imported_but_not_initialized_gets_the_driver_choice(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(False))
    choice = choose_gpu(1, {}, driver_of(FakeLibcuda(4)))
    assert str(choice) == "device 1 of 4 (by local rank 1)"
