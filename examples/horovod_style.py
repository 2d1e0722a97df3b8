"""A Horovod PyTorch training script, run on ringtrain by changing one line: the import.

    mpiexec -n 2 python examples/horovod_style.py
    mpiexec -n 4 python examples/horovod_style.py --epochs 10 --fp16-allreduce

Everything below is written against Horovod's API (``horovod.torch``) as a Horovod user
would write it; ``import ringtrain.horovod as hvd`` gives the same names. The data are
made up here from ``--seed`` (random inputs labelled by a fixed random "teacher"
network, 8 classes, the most frequent about a fifth of the samples). Each rank trains on
its shard (``DistributedSampler`` with ``hvd.size()`` replicas), the learning rate is
scaled by the number of batches in a step (``hvd.size()`` times
``--batches-per-allreduce``), rank 0's weights and optimizer state are broadcast before
training, and the held-out accuracy is averaged over the ranks with ``hvd.allreduce``.
With a GPU (unless ``--no-cuda``) each rank trains on the GPU at its local rank, as
Horovod's examples do. Rank 0 prints a line per epoch and a last line ``N ranks: final
accuracy ...``.
"""

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringtrain.horovod as hvd  # was: import horovod.torch as hvd

FEATURES = 16
CLASSES = 8


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--samples", type=int, default=16384,
                        help="training samples (the held-out set has a quarter as many)")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as float16")
    parser.add_argument("--batches-per-allreduce", type=int, default=1,
                        help="local backward passes per optimizer step")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    arguments = parser.parse_args()
    arguments.cuda = not arguments.no_cuda and torch.cuda.is_available()
    return arguments


def make_datasets(samples: int, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Training and held-out sets, the same on every rank (a function of the seed)."""
    rng = np.random.default_rng(seed)
    teacher_hidden = rng.standard_normal((FEATURES, 32)) / np.sqrt(FEATURES)
    teacher_output = rng.standard_normal((32, CLASSES))
    inputs = rng.standard_normal((samples + samples // 4, FEATURES)).astype(np.float32)
    labels = np.argmax(np.tanh(inputs @ teacher_hidden) @ teacher_output, axis=1)
    inputs, labels = torch.from_numpy(inputs), torch.from_numpy(labels)
    return (TensorDataset(inputs[:samples], labels[:samples]),
            TensorDataset(inputs[samples:], labels[samples:]))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def metric_average(value: float, name: str) -> float:
    """The mean of ``value`` over the ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def train(epoch, model, optimizer, loader, sampler, batches_per_allreduce, cuda):
    model.train()
    sampler.set_epoch(epoch)
    total = 0.0
    optimizer.zero_grad()
    for index, (data, target) in enumerate(loader, 1):
        if cuda:
            data, target = data.cuda(), target.cuda()
        loss = F.cross_entropy(model(data), target)
        (loss / batches_per_allreduce).backward()
        if index % batches_per_allreduce == 0 or index == len(loader):
            optimizer.step()
            optimizer.zero_grad()
        total += loss.item()
    return metric_average(total / len(loader), "avg_loss")


def test(model, loader, cuda):
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in loader:
            if cuda:
                data, target = data.cuda(), target.cuda()
            correct += (model(data).argmax(dim=1) == target).sum().item()
    return metric_average(correct / len(loader.sampler), "avg_accuracy")


def main() -> None:
    args = parse_arguments()
    hvd.init()
    if args.cuda:  # ranks share the GPUs when there are fewer GPUs than ranks
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    torch.manual_seed(args.seed + hvd.rank())  # different weights until the broadcast
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // hvd.local_size()))

    train_set, test_set = make_datasets(args.samples, args.seed)
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                      shuffle=False)
    test_loader = DataLoader(test_set, batch_size=1000, sampler=test_sampler)

    model = Net()
    if args.cuda:
        model.cuda()
    # The global batch is hvd.size() * batches_per_allreduce times larger: so is the rate.
    optimizer = torch.optim.SGD(model.parameters(),
                                lr=args.lr * hvd.size() * args.batches_per_allreduce,
                                momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average,
                                         backward_passes_per_step=args.batches_per_allreduce)

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        loss = train(epoch, model, optimizer, train_loader, train_sampler,
                     args.batches_per_allreduce, args.cuda)
        accuracy = test(model, test_loader, args.cuda)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {loss:.4f}, accuracy {accuracy:.3f}", flush=True)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks: final accuracy {accuracy:.3f}, "
              f"{time.perf_counter() - start:.1f} s, "
              f"compression {'fp16' if args.fp16_allreduce else 'none'}, "
              f"{'GPU' if args.cuda else 'CPU'}", flush=True)


if __name__ == "__main__":
    main()
