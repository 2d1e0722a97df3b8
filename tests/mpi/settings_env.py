"""Settings from RINGTRAIN_* environment variables, on every rank.

Expects the environment set by tests/test_collectives_mpi.py (see ENVIRONMENT below):
a ring allreduce with 1 KiB segments, a pipeline threshold of 2 KiB, and a malformed
broadcast algorithm that must be ignored with a warning.

Run: RINGTRAIN_ALLREDUCE_ALGORITHM=ring RINGTRAIN_SEGMENT_BYTES=1K \
     RINGTRAIN_BROADCAST_PIPELINE_MIN_BYTES=2KiB RINGTRAIN_BROADCAST_ALGORITHM=bogus \
     mpiexec -n K python tests/mpi/settings_env.py
"""

from __future__ import annotations

import os
import warnings

import numpy as np

import ringtrain as rt
from ringtrain.collectives import config
from _harness import (Digests, assert_equal_arrays, assert_reduced, check, configured,
                      expect_raises, main, make_input, reduce_reference)

ENVIRONMENT = {
    "RINGTRAIN_ALLREDUCE_ALGORITHM": "ring",
    "RINGTRAIN_SEGMENT_BYTES": "1K",
    "RINGTRAIN_BROADCAST_PIPELINE_MIN_BYTES": "2KiB",
    "RINGTRAIN_BROADCAST_ALGORITHM": "bogus",
}


@check
def environment_is_as_expected():
    for variable, value in ENVIRONMENT.items():
        assert os.environ.get(variable) == value, (
            f"this program expects {variable}={value!r} in its environment, found "
            f"{os.environ.get(variable)!r}")


@check
def settings_follow_the_environment():
    config.reset_settings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = rt.current_settings()
    assert settings.allreduce_algorithm == "ring"
    assert settings.segment_bytes == 1024
    assert settings.broadcast_pipeline_min_bytes == 2048
    assert settings.broadcast_algorithm == "auto", "a malformed value must be ignored"
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("RINGTRAIN_BROADCAST_ALGORITHM" in m for m in messages), messages
    assert not any("RINGTRAIN_SEGMENT_BYTES" in m for m in messages), messages


@check
def collectives_use_the_environment():
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for n in (1, 13, 1000 * k + 1):  # 1 KiB segments: several per chunk at the largest size
        for op in (rt.Sum, rt.Average, rt.Product):
            inputs = [make_input(r, (n,), np.float32, op, "env") for r in range(k)]
            y = rt.allreduce(inputs[me], op)
            assert_reduced(y, reduce_reference(inputs, op), np.dtype(np.float32),
                           f"allreduce n={n} {op.name} with the environment's settings")
            digests.add(f"{n} {op.name}", y)
    for root in range(k):
        expected = make_input(root, (5000,), np.uint8, None, "env-bcast")
        y = rt.broadcast(make_input(me, (5000,), np.uint8, None, "env-bcast"), root)
        assert_equal_arrays(y, expected, f"broadcast root={root} over the 2 KiB threshold")
    digests.verify()


@check(min_size=2)
def the_environment_choice_shows_in_a_mismatch():
    """The last rank asks for recursive doubling; the others use the environment's ring."""
    k, me = rt.size(), rt.rank()
    algorithm = "recursive_doubling" if me == k - 1 else None
    error = expect_raises(rt.MismatchError, rt.allreduce, np.ones(8, np.float32), rt.Sum,
                          name="env", algorithm=algorithm)
    assert error.differences["algorithm"] == {
        r: ("recursive_doubling" if r == k - 1 else "ring") for r in range(k)}, error.differences
    y = rt.allreduce(np.ones(3, np.float32), rt.Sum)
    assert_equal_arrays(y, np.full(3, k, np.float32), "allreduce after the mismatch")


@check
def configure_overrides_the_environment():
    with configured(allreduce_algorithm="native", segment_bytes=4096):
        assert rt.current_settings().allreduce_algorithm == "native"
        assert rt.current_settings().segment_bytes == 4096
        y = rt.allreduce(np.full(4, 2.0), rt.Product)
        assert_equal_arrays(y, np.full(4, 2.0 ** rt.size()), "allreduce with native configured")
    config.reset_settings()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert rt.current_settings().allreduce_algorithm == "ring"


if __name__ == "__main__":
    main()
