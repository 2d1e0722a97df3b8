"""broadcast_parameters and broadcast_optimizer_state: every rank ends with the root's
state, bit for bit; ranks whose models differ get a MismatchError naming the tensor.

Every rank builds its own values (a function of its rank), so every rank can compute
what the root holds and compare byte by byte; digests exchanged over MPI.COMM_WORLD
check that all ranks hold the same bytes. The torch checks are left out, with a SKIP
line, when torch is not installed.

Run: mpiexec -n K python tests/mpi/trainer_broadcast.py [--only SUBSTRING]
"""

from __future__ import annotations

from typing import Any

import numpy as np

import ringtrain as rt
from _harness import (COPY_DTYPES, WORLD, Digests, check, expect_raises, log, main, rng,
                      same_on_all_ranks)
from ringtrain.trainer.state_broadcast import broadcast_optimizer_state, broadcast_parameters

try:
    import torch
except ImportError:
    torch = None

# dtypes beyond what the collectives move themselves travel as bytes
EXTRA_DTYPES = [np.dtype(t) for t in (np.uint16, np.uint32, np.uint64, np.complex64,
                                      np.complex128, ">f8")]
SHAPES = [(), (0,), (1,), (13,), (3, 5), (2, 0), (7, 1, 3)]


# --------------------------------------------------------------------------- helpers

def bits(rank: int, shape: tuple[int, ...], dtype: np.dtype, *key: object) -> np.ndarray:
    """Rank's array of random bits (NaN payloads included); bools are 0 or 1."""
    dtype = np.dtype(dtype)
    g = rng(rank, tuple(shape), dtype.str, *key)
    if dtype.kind == "b":
        return g.integers(0, 2, size=shape).astype(np.bool_)
    count = int(np.prod(shape)) * dtype.itemsize
    return g.integers(0, 256, count, dtype=np.uint8).view(dtype).reshape(shape)


def numpy_params(rank: int, *key: object) -> dict[str, np.ndarray]:
    return {f"{dtype.str} {shape}": bits(rank, shape, dtype, *key)
            for dtype in COPY_DTYPES + EXTRA_DTYPES for shape in SHAPES}


def raw(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor's or array's dtype, shape and bytes."""
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes()
    flat = value.detach().cpu().contiguous().reshape(-1)
    return str(value.dtype), tuple(value.shape), flat.view(torch.uint8).numpy().tobytes()


def assert_same_bits(actual: Any, expected: Any, what: str) -> None:
    (dtype, shape, data), (want_dtype, want_shape, want_data) = raw(actual), raw(expected)
    assert (dtype, shape) == (want_dtype, want_shape), \
        f"{what}: {dtype} {shape}, expected {want_dtype} {want_shape}"
    assert data == want_data, f"{what}: the bytes differ from the root's"


def assert_all_same_bits(actual: dict, expected: dict, what: str) -> None:
    """The same names, each with the expected bits; and the same bits on every rank."""
    assert list(actual) == list(expected), f"{what}: names {list(actual)}, {list(expected)}"
    digests = Digests()
    for name in sorted(actual):  # the same order on every rank
        assert_same_bits(actual[name], expected[name], f"{what}: {name}")
        digests.add(f"{what}: {name}", np.frombuffer(raw(actual[name])[2], np.uint8))
    digests.verify()


def library_still_works() -> None:
    k, me = rt.size(), rt.rank()
    values = {"after": np.full(3, me, np.int32)}
    broadcast_parameters(values, root_rank=k - 1)
    assert values["after"].tolist() == [k - 1] * 3, "broadcast_parameters after an error"


# --------------------------------------------------------------------------- numpy parameters

@check
def numpy_dict_every_root_dtype_and_shape():
    k, me = rt.size(), rt.rank()
    for root in range(k):
        params = numpy_params(me, "dict", root)
        if me % 2:  # the order a dict was filled in does not matter: names are sorted
            params = dict(reversed(params.items()))
        storage = {name: array for name, array in params.items()}
        broadcast_parameters(params, root_rank=root)
        for name, array in params.items():
            assert array is storage[name], f"{name}: replaced, not written in place"
        expected = numpy_params(root, "dict", root)
        assert_all_same_bits(params, {name: expected[name] for name in params},
                             f"numpy dict root={root}")


@check
def numpy_list_and_tuple_every_root():
    k, me = rt.size(), rt.rank()
    for root in range(k):
        for kind in (list, tuple) if root == k - 1 else (list,):
            arrays = kind(numpy_params(me, "list", root).values())
            broadcast_parameters(arrays, root)
            expected = list(numpy_params(root, "list", root).values())
            assert_all_same_bits(dict(enumerate(arrays)), dict(enumerate(expected)),
                                 f"numpy {kind.__name__} root={root}")


@check
def numpy_noncontiguous_views():
    """Only the views' elements are written; the rest of each base keeps its values."""
    k, me = rt.size(), rt.rank()
    for root in range(k):
        for dtype in (np.dtype(np.float32), np.dtype(np.complex64), np.dtype(np.uint16)):
            base = bits(me, (6, 8), dtype, "nc")
            params = {"strided": base[::2, 1::3], "transposed": bits(me, (5, 3), dtype, "t").T,
                      "reversed": bits(me, (9,), dtype, "r")[::-1]}
            broadcast_parameters(params, root)
            want_base = bits(me, (6, 8), dtype, "nc")
            want_base[::2, 1::3] = bits(root, (6, 8), dtype, "nc")[::2, 1::3]
            assert_same_bits(base, want_base, f"strided view of {dtype} root={root}")
            assert_same_bits(params["transposed"], bits(root, (5, 3), dtype, "t").T,
                             f"transposed {dtype} root={root}")
            assert_same_bits(params["reversed"], bits(root, (9,), dtype, "r")[::-1],
                             f"reversed {dtype} root={root}")


@check
def empty_params_and_a_numpy_integer_root():
    me = rt.rank()
    broadcast_parameters({})
    broadcast_parameters([])
    broadcast_parameters(iter(()))
    values = [np.full(2, me, np.int64)]
    broadcast_parameters(values, root_rank=np.int64(0))
    assert values[0].tolist() == [0, 0]


# --------------------------------------------------------------------------- mismatches

def expect_mismatch_naming(params: Any, *names: str, root: int = 0) -> None:
    error = expect_raises(rt.MismatchError, broadcast_parameters, params, root, match=names)
    same_on_all_ranks(str(error), "the MismatchError's message")
    library_still_works()


@check(min_size=2)
def mismatched_name_on_the_last_rank():
    k, me = rt.size(), rt.rank()
    params = {"layer1.weight": np.zeros(4, np.float32), "layer2.bias": np.zeros(3, np.float32)}
    if me == k - 1:
        params["layer2.beta"] = params.pop("layer2.bias")
    expect_mismatch_naming(params, "'layer2.bias'", "'layer2.beta'")


@check(min_size=2)
def extra_parameter_on_the_last_rank_or_on_the_root():
    k, me = rt.size(), rt.rank()
    for odd in (k - 1, 0):
        params = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.int64)}
        if me == odd:
            params["c.extra"] = np.zeros(2, np.float64)
        expect_mismatch_naming(params, "'c.extra'")
        params = [("a", np.zeros(4, np.float32))]
        if me == odd:
            params.insert(0, ("first.extra", np.zeros(1, np.float32)))
        expect_mismatch_naming(params, "'first.extra'", "'a'")


@check(min_size=2)
def mismatched_shape_and_dtype_name_the_parameter():
    k, me = rt.size(), rt.rank()
    shape = (5,) if me == k - 1 else (4,)
    expect_mismatch_naming({"conv.weight": np.zeros(shape, np.float32)}, "'conv.weight'",
                           "(5,)", "(4,)")
    dtype = np.float64 if me == k - 1 else np.float32
    expect_mismatch_naming({"fc.bias": np.zeros(3, dtype)}, "'fc.bias'", "float64",
                           "float32")


# --------------------------------------------------------------------------- bad arguments

@check
def entries_that_are_not_tensors_are_refused_before_communicating():
    k = rt.size()
    expect_raises(rt.InvalidArgumentError, broadcast_parameters,
                  {"w": np.zeros(3), "bn.momentum": 0.1}, match=["'bn.momentum'", "float"])
    expect_raises(rt.InvalidArgumentError, broadcast_parameters,
                  [np.zeros(3), np.array([None, 1])], match=["'parameter 1'", "object"])
    expect_raises(rt.InvalidArgumentError, broadcast_parameters, 5, match=["int"])
    for root in (k, -1, 0.0, True):
        expect_raises(rt.InvalidArgumentError, broadcast_parameters, {"w": np.zeros(3)}, root,
                      match=["root_rank", "'w'"])
        expect_raises(rt.InvalidArgumentError, broadcast_optimizer_state,
                      NumpyMomentum(np.zeros(3)), root, match=["root_rank"])
    library_still_works()


# --------------------------------------------------------------------------- numpy optimizer

class NumpyMomentum:
    """SGD with momentum over numpy arrays: the plain state_dict protocol."""

    def __init__(self, weights: np.ndarray, lr: float = 0.1, momentum: float = 0.9):
        self.weights = weights
        self.lr, self.momentum = lr, momentum
        self.velocity: np.ndarray | None = None
        self.steps = 0

    def step(self, gradient: np.ndarray) -> None:
        if self.velocity is None:
            self.velocity = np.zeros_like(self.weights)
        self.velocity = self.momentum * self.velocity + gradient
        self.weights -= self.lr * self.velocity
        self.steps += 1

    def state_dict(self) -> dict:
        state = {} if self.velocity is None else {
            "velocity": self.velocity, "history": [(self.steps, self.velocity.sum()),
                                                   np.float32(self.lr)]}
        return {"state": state, "hyper": {"lr": self.lr, "momentum": self.momentum},
                "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.lr, self.momentum = state["hyper"]["lr"], state["hyper"]["momentum"]
        self.velocity = state["state"].get("velocity")
        self.steps = state["steps"]


@check
def numpy_optimizer_protocol_every_root():
    k, me = rt.size(), rt.rank()
    for root in range(k):
        optimizers = {}
        for r in range(k):  # every rank builds every rank's optimizer: the reference
            optimizers[r] = NumpyMomentum(np.zeros(5), lr=0.1 * (r + 1),
                                          momentum=0.5 + 0.1 * r)
            for step in range(r % 3):  # rank 0 never stepped, others once or twice
                optimizers[r].step(rng(r, "g", step).uniform(-1, 1, 5))
        mine = optimizers[me]
        broadcast_optimizer_state(mine, root)
        expected = optimizers[root]
        assert (mine.lr, mine.momentum, mine.steps) == \
            (expected.lr, expected.momentum, expected.steps), f"root={root}"
        if expected.velocity is None:
            assert mine.velocity is None, f"root={root}: velocity appeared"
        else:
            assert_same_bits(mine.velocity, expected.velocity, f"velocity root={root}")
        same_on_all_ranks(repr(mine.state_dict()), f"numpy optimizer state root={root}")


@check
def optimizer_state_as_a_tuple_of_arrays_and_scalars():
    k, me = rt.size(), rt.rank()

    class Opaque:
        def __init__(self, rank: int):
            self.state = {"moments": (bits(rank, (3, 2), np.float32, "m"),
                                      bits(rank, (), np.complex128, "c")),
                          7: [bits(rank, (0,), np.int8, "e"), "text", None, rank]}

        def state_dict(self) -> dict:
            return self.state

        def load_state_dict(self, state: dict) -> None:
            self.state = state

    root = k - 1
    opaque = Opaque(me)
    broadcast_optimizer_state(opaque, root)
    expected = Opaque(root).state
    moments = opaque.state["moments"]
    assert isinstance(moments, tuple) and set(opaque.state) == {"moments", 7}
    assert_same_bits(moments[0], expected["moments"][0], "moments[0]")
    assert_same_bits(moments[1], expected["moments"][1], "moments[1] (0-d complex)")
    assert_same_bits(opaque.state[7][0], expected[7][0], "empty int8")
    assert opaque.state[7][1:] == ["text", None, root]


@check(min_size=2)
def optimizer_state_that_cannot_be_pickled_fails_on_every_rank():
    class Unpicklable:
        def state_dict(self) -> dict:
            return {"lr": 0.1, "schedule": lambda step: 0.1}

        def load_state_dict(self, state: dict) -> None:
            raise AssertionError("loaded a state that could not be sent")

    error = expect_raises(rt.MismatchError, broadcast_optimizer_state, Unpicklable(),
                          match=["'optimizer state'", "pickling", "failed"])
    same_on_all_ranks(str(error), "the MismatchError's message")
    library_still_works()


# --------------------------------------------------------------------------- torch

def build_model(seed: int) -> Any:
    """Linear + BatchNorm1d (an int64 buffer) + Linear, and buffers in dtypes numpy lacks
    or the collectives do not move; trained in train mode ``seed + 1`` times so every
    buffer (running stats, num_batches_tracked) depends on the seed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.ReLU(), torch.nn.Linear(4, 3))
    g = torch.Generator().manual_seed(seed)
    model.register_buffer("scale_bf16", torch.randn(3, 2, generator=g).to(torch.bfloat16))
    model.register_buffer("offset_bf16_0d", torch.randn((), generator=g).to(torch.bfloat16))
    model.register_buffer("mask", torch.rand(6, generator=g) > 0.5)
    model.register_buffer("phase", torch.randn(4, generator=g, dtype=torch.complex64))
    model.register_buffer("counts", torch.randint(0, 1000, (5,), generator=g,
                                                  dtype=torch.int16))
    model.train()
    with torch.no_grad():
        for _ in range(seed + 1):
            model(torch.randn(8, 5, generator=g))
    return model


def torch_check(function=None, *, needs_cuda: bool = False, **options):
    """Register a check that needs torch (and a CUDA device), or log that it is skipped."""
    def register(f):
        missing = ("torch is not installed" if torch is None else
                   "no CUDA device" if needs_cuda and not torch.cuda.is_available() else None)
        if missing is None:
            return check(f, **options)
        if WORLD.Get_rank() == 0:
            log(f"rank 0: SKIP {f.__name__} ({missing})")
        return f

    return register(function) if function is not None else register


@torch_check
def torch_state_dict_every_root():
    k, me = rt.size(), rt.rank()
    for root in range(k):
        model = build_model(me)
        state = model.state_dict()
        assert state["1.num_batches_tracked"].dtype == torch.int64
        assert state["1.num_batches_tracked"].item() == me + 1
        broadcast_parameters(state, root_rank=root)
        expected = build_model(root).state_dict()
        assert_all_same_bits(model.state_dict(), expected, f"torch state_dict root={root}")
        assert model.state_dict()["1.num_batches_tracked"].item() == root + 1


@torch_check
def torch_named_parameters_generator_and_list():
    k, me = rt.size(), rt.rank()
    root = k - 1
    model = build_model(me)
    parameters = (pair for pair in model.named_parameters())
    broadcast_parameters(parameters, root_rank=root)
    reference = build_model(root)
    assert_all_same_bits(dict(model.named_parameters()), dict(reference.named_parameters()),
                         "named_parameters()")
    # buffers were not in the generator: they keep this rank's values
    assert model.state_dict()["1.num_batches_tracked"].item() == me + 1
    model = build_model(me)
    broadcast_parameters(list(model.parameters()), root_rank=0)
    assert_all_same_bits(dict(model.named_parameters()),
                         dict(build_model(0).named_parameters()), "list(parameters())")
    assert all(p.requires_grad for p in model.parameters())


@torch_check
def torch_noncontiguous_tensors():
    k, me = rt.size(), rt.rank()
    for root in range(k):
        def tensors(rank):
            g = torch.Generator().manual_seed(rank)
            base = torch.randn(6, 8, generator=g)
            half = torch.randn(4, 6, generator=g).to(torch.bfloat16)
            return base, half, {"transposed": torch.randn(3, 5, generator=g).t(),
                                "strided": base[1::2, ::3], "bf16 strided": half[:, 1::2]}

        base, half, params = tensors(me)
        assert not any(t.is_contiguous() for t in params.values())
        broadcast_parameters(params, root)
        want_base, want_half, want = tensors(root)
        for name in params:
            assert_same_bits(params[name], want[name], f"{name} root={root}")
        own_base, own_half, _ = tensors(me)
        own_base[1::2, ::3] = want_base[1::2, ::3]
        own_half[:, 1::2] = want_half[:, 1::2]
        assert_same_bits(base, own_base, f"the strided view's base root={root}")
        assert_same_bits(half, own_half, f"the bf16 view's base root={root}")


def make_optimizer(kind: str, model: Any, lr: float) -> Any:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-3)
    if kind == "adam amsgrad":
        return torch.optim.Adam(model.parameters(), lr=lr, amsgrad=True)
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    return torch.optim.SGD([{"params": first}, {"params": second, "lr": lr * 3}], lr=lr,
                           momentum=0.9)


def train_step(model: Any, optimizer: Any, key: int, device: Any = "cpu") -> None:
    g = torch.Generator().manual_seed(1000 + key)
    optimizer.zero_grad()
    loss = model(torch.randn(8, 5, generator=g).to(device)).square().mean()
    loss.backward()
    optimizer.step()


def optimizer_view(optimizer: Any) -> Any:
    """The state dict with each tensor replaced by its dtype, shape and bytes."""
    def walk(value):
        if isinstance(value, torch.Tensor):
            return raw(value)
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item) for item in value)
        return value

    return walk(optimizer.state_dict())


@torch_check
def torch_optimizer_state_from_a_stepped_root_to_empty_ranks():
    k, me = rt.size(), rt.rank()
    for kind in ("adam", "adam amsgrad", "sgd momentum"):
        for root in range(k):
            model = build_model(me)
            optimizer = make_optimizer(kind, model, lr=0.01 * (me + 1))
            if me == root:  # two steps, the second with another learning rate
                train_step(model, optimizer, 1)
                for group in optimizer.param_groups:
                    group["lr"] *= 0.5
                train_step(model, optimizer, 2)
            elif me % 2:  # some other ranks stepped once, with their own learning rate
                train_step(model, optimizer, 3 + me)
            else:
                assert not optimizer.state
            broadcast_parameters(model.state_dict(), root)
            broadcast_optimizer_state(optimizer, root)
            what = f"{kind} root={root}"
            view = optimizer_view(optimizer)
            same_on_all_ranks(view, f"{what}: state after the broadcast")
            assert len(optimizer.state) == len(list(model.parameters())), what
            lrs = [group["lr"] for group in optimizer.param_groups]
            expected = [0.01 * (root + 1) * 0.5]
            if "sgd" in kind:
                expected.append(0.01 * (root + 1) * 3 * 0.5)
            assert lrs == expected, f"{what}: lr {lrs}, expected {expected}"
            if "adam" in kind:
                steps = {float(s["step"]) for s in optimizer.state.values()}
                assert steps == {2.0}, f"{what}: steps {steps}"
            # the same step everywhere keeps the ranks in step
            before = raw(next(model.parameters()))
            train_step(model, optimizer, 9)
            assert raw(next(model.parameters())) != before, f"{what}: the step changed nothing"
            same_on_all_ranks([raw(p) for p in model.parameters()],
                              f"{what}: parameters after one more step")
            same_on_all_ranks(optimizer_view(optimizer), f"{what}: state after one more step")


@torch_check
def torch_optimizer_never_stepped_anywhere():
    k, me = rt.size(), rt.rank()
    for root in range(k):
        model = build_model(0)
        optimizer = make_optimizer("adam", model, lr=0.001 * (me + 1))
        broadcast_optimizer_state(optimizer, root)
        assert not optimizer.state, "state appeared without a step"
        assert optimizer.param_groups[0]["lr"] == 0.001 * (root + 1)
        same_on_all_ranks(optimizer_view(optimizer), f"never stepped, root={root}")


@torch_check
def torch_wrapped_optimizer_and_tensor_learning_rate():
    me = rt.rank()

    class Wrapper:
        """Exposes the optimizer it wraps and delegates its state."""

        def __init__(self, optimizer):
            self.optimizer = optimizer

        def state_dict(self):
            return self.optimizer.state_dict()

        def load_state_dict(self, state):
            self.optimizer.load_state_dict(state)

    model = build_model(0)
    inner = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01 * (me + 1)))
    if me == 0:
        train_step(model, inner, 5)
    broadcast_parameters(model.state_dict(), 0)
    broadcast_optimizer_state(Wrapper(inner), root_rank=0)
    lr = inner.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == torch.tensor(0.01).item()
    same_on_all_ranks(optimizer_view(inner), "wrapped optimizer state")


@torch_check(min_size=2)
def torch_on_a_process_set():
    """Ranks 1.. take rank k-1's state; rank 0, outside the set, keeps its own."""
    k, me = rt.size(), rt.rank()
    members = list(range(1, k))
    ps = rt.add_process_set(members)
    model = build_model(me)
    optimizer = make_optimizer("sgd momentum", model, lr=0.1 * (me + 1))
    train_step(model, optimizer, me)
    own = ([raw(p) for p in model.parameters()], optimizer_view(optimizer))
    root = members[-1]
    if ps.included():
        broadcast_parameters(model.state_dict(), root, process_set=ps)
        broadcast_optimizer_state(optimizer, root, process_set=ps)
        assert optimizer.param_groups[0]["lr"] == 0.1 * (root + 1)
    rt.remove_process_set(ps)
    states = WORLD.allgather(([raw(p) for p in model.parameters()], optimizer_view(optimizer)))
    assert all(states[r] == states[root] for r in members), "the members' states differ"
    if me == 0:
        assert states[0] == own and (k == 2 or states[0] != states[root]), \
            "a rank outside the process set was changed"


@torch_check(needs_cuda=True)
def torch_cuda_tensors_are_staged_through_the_host():
    k, me = rt.size(), rt.rank()
    device = torch.device("cuda", me % torch.cuda.device_count())
    for root in range(k):
        model = build_model(me).to(device)
        optimizer = make_optimizer("adam", model, lr=0.01 * (me + 1))
        if me == root:
            train_step(model, optimizer, 4, device)
        parameters = model.state_dict()
        broadcast_parameters(parameters, root)
        broadcast_optimizer_state(optimizer, root)
        what = f"CUDA root={root}"
        assert all(t.device == device for t in model.state_dict().values()), what
        assert all(t.device == device for s in optimizer.state.values()
                   for name, t in s.items() if name != "step"), what
        assert all(a.data_ptr() == b.data_ptr()
                   for a, b in zip(parameters.values(), model.state_dict().values())), what
        same_on_all_ranks({n: raw(t) for n, t in model.state_dict().items()},
                          f"{what}: state_dict")
        same_on_all_ranks(optimizer_view(optimizer), f"{what}: optimizer state")
        assert len(optimizer.state) == len(list(model.parameters())), what


if torch is not None:
    torch.set_num_threads(1)  # several ranks share the cores

if __name__ == "__main__":
    main()
