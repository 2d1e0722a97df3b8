"""Train an MLP written in plain numpy on every rank, with gradients averaged across ranks.

    mpiexec -n 2 python examples/numpy_mlp.py
    mpiexec -n 4 python examples/numpy_mlp.py --epochs 10 --compression bf16

No framework: the forward and backward passes are written out, every gradient lives in
an array allocated once and overwritten in place each step, and the optimizer (SGD with
momentum) is a small class of our own. ``rt.DistributedOptimizer`` wraps it given
``(name, parameter, gradient)`` triples (the protocol is described in
``ringtrain.trainer.array_optimizer``); the backward pass calls
``optimizer.mark_ready(name)`` as soon as each gradient is final, last layer first, so
that gradient's allreduce runs on ringtrain's collectives thread while the earlier
layers' gradients are still being computed. ``optimizer.step()`` waits for the
allreduces, then steps.

The data are made up here, from ``--seed`` alone, so every rank builds the same set:
random inputs labelled by a fixed random "teacher" network (8 classes; the most
frequent holds about a fifth of the samples, the level to beat).
``rt.DistributedSampler`` deals each rank its shard of the training set (``"pad"``
mode: every rank runs as many steps) and of the held-out set (``"exact"``: every sample
once); the held-out counts are summed over the ranks, so the accuracy printed is that
of the whole set. Each rank initialises its weights differently, on purpose:
``rt.broadcast_parameters`` and ``rt.broadcast_optimizer_state`` start every rank from
rank 0's.

The collectives take host (numpy) arrays, so this example does not use CuPy even where
it is installed.

Rank 0 prints a line per epoch (training loss over all ranks, held-out accuracy,
samples per second over all ranks, seconds) and a last line ``N ranks: final accuracy
...``; with ``--progress always`` (or when stdout is a terminal, which it is not under
mpiexec) also a progress bar. ``--batch-size`` is per rank.
"""

import argparse
import hashlib
import os
import time
from collections.abc import Callable, Iterator

# One BLAS thread per rank unless told otherwise (ringtrain-run sets OMP_NUM_THREADS to
# the node's cores over its ranks), before numpy loads its BLAS: the ranks already fill
# the cores. With two ranks on two cores, OpenBLAS's default of a thread per core made
# every step 200 times slower (its threads spin while they wait).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import ringtrain as rt  # noqa: E402
from _progress import (PROGRESS_CHOICES, PROGRESS_HELP, ProgressBar, epoch_line,  # noqa: E402
                       show_bar)

FEATURES = 16
CLASSES = 8
TEACHER_HIDDEN = 32


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--samples", type=int, default=16384,
                        help="training samples (the held-out set has a quarter as many)")
    parser.add_argument("--hidden", type=int, default=128, help="width of the hidden layers")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--compression", choices=("none", "fp16", "bf16"), default="none",
                        help="how gradients travel")
    parser.add_argument("--fusion-threshold", type=int, default=None,
                        help="gradient bucket size in bytes, 0 for one allreduce per "
                             "gradient (default: RINGTRAIN_FUSION_THRESHOLD or 8 MiB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data")
    parser.add_argument("--progress", choices=PROGRESS_CHOICES, default="auto",
                        help=PROGRESS_HELP)
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.samples < 4:
        parser.error("--epochs and --batch-size must be at least 1, --samples at least 4")
    return args


def make_datasets(samples: int, seed: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Training and held-out (inputs, labels), a function of ``samples`` and ``seed`` only."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((FEATURES, TEACHER_HIDDEN)) / np.sqrt(FEATURES)
    output = rng.standard_normal((TEACHER_HIDDEN, CLASSES))
    inputs = rng.standard_normal((samples + samples // 4, FEATURES)).astype(np.float32)
    labels = np.argmax(np.tanh(inputs @ hidden) @ output, axis=1)
    return (inputs[:samples], labels[:samples]), (inputs[samples:], labels[samples:])


class MLP:
    """``relu(x @ W + b)`` layers, the last without the relu, for softmax cross-entropy.

    The parameters and their gradients are arrays allocated once; ``backward`` writes
    the gradients in place.
    """

    def __init__(self, sizes: list[int], rng: np.random.Generator):
        self.weights = [(rng.standard_normal((n_in, n_out)) * np.sqrt(2 / n_in))
                        .astype(np.float32) for n_in, n_out in zip(sizes[:-1], sizes[1:])]
        self.biases = [np.zeros(n_out, np.float32) for n_out in sizes[1:]]
        self.weight_gradients = [np.zeros_like(weight) for weight in self.weights]
        self.bias_gradients = [np.zeros_like(bias) for bias in self.biases]
        self._layer_inputs: list[np.ndarray] = []

    def named_parameters(self) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        """``(name, parameter, gradient)`` triples, first layer first."""
        for layer, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            yield f"layer{layer}.weight", weight, self.weight_gradients[layer]
            yield f"layer{layer}.bias", bias, self.bias_gradients[layer]

    def forward(self, inputs: np.ndarray) -> np.ndarray:
        """The logits; keeps each layer's input for ``backward``."""
        self._layer_inputs = []
        activations = inputs
        for layer, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            self._layer_inputs.append(activations)
            activations = activations @ weight + bias
            if layer < len(self.weights) - 1:
                np.maximum(activations, 0, out=activations)
        return activations

    def backward(self, logits: np.ndarray, labels: np.ndarray,
                 on_ready: Callable[[str], None]) -> float:
        """Write the gradients of the mean cross-entropy of the last ``forward``; return it.

        ``on_ready(name)`` is called as each gradient is final, last layer first.
        """
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        rows = np.arange(len(labels))
        loss = -float(log_probabilities[rows, labels].mean())
        delta = np.exp(log_probabilities)  # d loss / d logits: (softmax - one-hot) / batch
        delta[rows, labels] -= 1
        delta /= len(labels)
        for layer in reversed(range(len(self.weights))):
            layer_input = self._layer_inputs[layer]
            np.matmul(layer_input.T, delta, out=self.weight_gradients[layer])
            np.sum(delta, axis=0, out=self.bias_gradients[layer])
            # From here on these two arrays belong to the allreduce until step().
            on_ready(f"layer{layer}.weight")
            on_ready(f"layer{layer}.bias")
            if layer:
                delta = (delta @ self.weights[layer].T) * (layer_input > 0)
        return loss


class MomentumSGD:
    """SGD with momentum over arrays: ``v = momentum * v + g; p -= lr * v``, in place.

    Args:
        parameters: ``(parameter, gradient)`` pairs.
        lr: the learning rate.
        momentum: the velocity's decay.
    """

    def __init__(self, parameters: list[tuple[np.ndarray, np.ndarray]], lr: float,
                 momentum: float = 0.9):
        self.parameters = parameters
        self.lr = lr
        self.momentum = momentum
        self.velocities = [np.zeros_like(parameter) for parameter, _ in parameters]

    def step(self) -> None:
        for (parameter, gradient), velocity in zip(self.parameters, self.velocities):
            velocity *= self.momentum
            velocity += gradient
            parameter -= self.lr * velocity

    def state_dict(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "velocities": self.velocities}

    def load_state_dict(self, state: dict) -> None:
        self.lr, self.momentum = state["lr"], state["momentum"]
        for velocity, loaded in zip(self.velocities, state["velocities"]):
            velocity[...] = loaded


def batches(indices: list[int], batch_size: int) -> Iterator[np.ndarray]:
    indices = np.asarray(indices, np.int64)
    for start in range(0, len(indices), batch_size):
        yield indices[start:start + batch_size]


def evaluate(model: MLP, inputs: np.ndarray, labels: np.ndarray,
             sampler: rt.DistributedSampler) -> float:
    """Accuracy over the whole held-out set: each rank counts its shard, the counts are summed."""
    correct, seen = 0, 0
    for batch in batches(list(sampler), 1024):
        correct += int((model.forward(inputs[batch]).argmax(axis=1) == labels[batch]).sum())
        seen += len(batch)
    counts = rt.allreduce(np.array([correct, seen], np.int64), op=rt.Sum, name="accuracy")
    return int(counts[0]) / int(counts[1])


def parameters_digest(model: MLP) -> str:
    """A hash of the parameters' bits: equal on every rank while training is in sync."""
    digest = hashlib.sha256()
    for _, parameter, _ in model.named_parameters():
        digest.update(parameter.tobytes())
    return digest.hexdigest()


def main() -> None:
    args = parse_arguments()
    rt.init()
    rank, size = rt.rank(), rt.size()
    draw_bars = rank == 0 and show_bar(args.progress)

    (train_inputs, train_labels), (held_out_inputs, held_out_labels) = \
        make_datasets(args.samples, args.seed)
    train_sampler = rt.DistributedSampler(len(train_labels), mode="pad", seed=args.seed)
    held_out_sampler = rt.DistributedSampler(len(held_out_labels), mode="exact",
                                             shuffle=False)

    # Different weights on every rank, until the broadcast below.
    model = MLP([FEATURES, args.hidden, args.hidden, CLASSES],
                np.random.default_rng([args.seed, rank]))
    named = list(model.named_parameters())
    optimizer = rt.DistributedOptimizer(
        MomentumSGD([(parameter, gradient) for _, parameter, gradient in named],
                    lr=args.lr, momentum=args.momentum),
        named_parameters=named,
        compression=getattr(rt.Compression, args.compression),
        fusion_threshold=args.fusion_threshold)
    # Every rank starts from rank 0's weights and optimizer state (the velocities matter
    # when rank 0 has loaded a checkpoint; here they are still zero).
    rt.broadcast_parameters({name: parameter for name, parameter, _ in named}, root_rank=0)
    rt.broadcast_optimizer_state(optimizer, root_rank=0)

    start = time.perf_counter()
    trained = 0
    steps = -(-len(train_sampler) // args.batch_size)
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        train_sampler.set_epoch(epoch)
        bar = ProgressBar(f"epoch {epoch}/{args.epochs}", steps, enabled=draw_bars)
        loss_sum, seen = 0.0, 0
        for step, batch in enumerate(batches(list(train_sampler), args.batch_size), 1):
            logits = model.forward(train_inputs[batch])
            loss = model.backward(logits, train_labels[batch], optimizer.mark_ready)
            optimizer.step()  # waits for the allreduces, then steps with the averages
            loss_sum += loss * len(batch)
            seen += len(batch)
            bar.update(step, loss)
        bar.close()
        train_seconds = time.perf_counter() - epoch_start
        loss_sum, seen = rt.allreduce(np.array([loss_sum, seen], np.float64), op=rt.Sum,
                                      name="training loss")
        loss, seen = loss_sum / seen, int(seen)
        trained += seen
        accuracy = evaluate(model, held_out_inputs, held_out_labels, held_out_sampler)
        if rank == 0:
            print(epoch_line(epoch, args.epochs, loss, accuracy, seen, time.perf_counter() -
                             epoch_start, train_seconds), flush=True)
    seconds = time.perf_counter() - start

    if len(set(rt.allgather_object(parameters_digest(model), name="digest"))) != 1:
        raise RuntimeError("the ranks' parameters differ after training")
    if rank == 0:
        print(f"{size} ranks: final accuracy {accuracy:.3f}, loss {loss:.4f}, "
              f"{trained:,} samples in {seconds:.1f} s, compression {args.compression}, "
              f"parameters identical on every rank", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
