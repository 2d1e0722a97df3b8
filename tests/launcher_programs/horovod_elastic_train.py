"""A Horovod elastic training script in the shape of Horovod's PyTorch elastic examples,
run by ringtrain: only the import line says ringtrain.

usage: python horovod_elastic_train.py OUTPUT [EPOCHS]

A linear model learns 48 made-up samples with SGD and momentum, 4 samples per rank per
step; ``TorchState`` holds the model, the optimizer, an ``ElasticSampler``, the epoch, a
step counter and ``seen``: how many times each sample went into a committed step (every
rank's batch is gathered each step). The state is committed after every step; a reset
callback scales the learning rate by the number of ranks and prints it.

Rank 1 kills itself with SIGKILL at global step $RINGTRAIN_TEST_KILL_AT_STEP on the first
start only. At global step $RINGTRAIN_TEST_HOSTS_AT_STEP of the first start, rank 0
creates the file $RINGTRAIN_TEST_HOSTS_FILE (a discovery script then offers other hosts)
and waits until the launcher has noticed, so that the next commit resizes the job (or,
with $RINGTRAIN_TEST_CHECK_HOSTS=1, the ``check_host_updates()`` that then starts every
step). Rank 0
writes the final parameters to OUTPUT (.npy) and prints ``seen``.
"""

import os
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ringtrain.horovod as hvd  # was: import horovod.torch as hvd
from ringtrain import elastic

OUTPUT = sys.argv[1]
EPOCHS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
SAMPLES, FEATURES, BATCH, LR = 48, 5, 4, 0.02
KILL_AT_STEP = int(os.environ.get("RINGTRAIN_TEST_KILL_AT_STEP", "-1"))
HOSTS_AT_STEP = int(os.environ.get("RINGTRAIN_TEST_HOSTS_AT_STEP", "-1"))
CHECK_HOSTS = os.environ.get("RINGTRAIN_TEST_CHECK_HOSTS") == "1"

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
rows = np.random.default_rng(7).standard_normal((SAMPLES, FEATURES + 1))
dataset = TensorDataset(torch.arange(SAMPLES), torch.tensor(rows[:, :FEATURES]).float(),
                        torch.tensor(rows[:, FEATURES]).float())
model = torch.nn.Linear(FEATURES, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def on_state_reset():
    for group in optimizer.param_groups:
        group["lr"] = LR * hvd.size()
    print(f"reset with {hvd.size()} ranks", flush=True)


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0,
                               step=0, seen=np.zeros(SAMPLES, np.int64))
state.register_reset_callbacks([on_state_reset])


def change_hosts():
    open(os.environ["RINGTRAIN_TEST_HOSTS_FILE"], "w").close()
    notice = os.path.join(os.environ[elastic.ELASTIC_DIR_VARIABLE], "hosts-updated")
    deadline = time.monotonic() + 30
    while not os.path.exists(notice) and time.monotonic() < deadline:
        time.sleep(0.05)


@hvd.elastic.run
def train(state):
    print(f"start {elastic.restart_count()} at epoch {state.epoch} step {state.step} with "
          f"{hvd.size()} ranks", flush=True)
    for state.epoch in range(state.epoch, EPOCHS):
        for batch, (index, features, target) in enumerate(loader):
            if state.step == KILL_AT_STEP and elastic.restart_count() == 0 and hvd.rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step == HOSTS_AT_STEP and elastic.restart_count() == 0 and hvd.rank() == 0:
                change_hosts()
            if CHECK_HOSTS:
                state.check_host_updates()
            optimizer.zero_grad()
            loss = F.mse_loss(model(features).squeeze(1), target)
            loss.backward()
            optimizer.step()
            for indices in hvd.allgather_object(index.tolist()):
                state.seen[indices] += 1
            state.sampler.record_batch(batch, BATCH)
            state.step += 1
            state.commit()
        state.sampler.set_epoch(state.epoch + 1)


train(state)
if hvd.rank() == 0:
    np.save(OUTPUT, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    print("seen", state.seen.tolist(), flush=True)
