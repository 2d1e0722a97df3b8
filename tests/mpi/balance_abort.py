"""A rank that raises in the middle of balanced training ends the job; no rank hangs.

The last rank raises after its third step, while the others go on into the next step's
gradient reductions and the balancer's agreement, which it never reaches. ringtrain's
exception hook (installed by ``init`` in a job of several processes) prints the
traceback under a banner naming the rank and aborts every rank.

Run: mpiexec -n K python tests/mpi/balance_abort.py   (exits with MPI_Abort's status)
"""

import faulthandler
import signal

import torch

import ringtrain as rt

STEPS = 6

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks on a hang
    rt.init()
    balancer = rt.LoadBalancer(4 * rt.size(), interval=2)
    model = torch.nn.Linear(4, 2)
    optimizer = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        balance=balancer)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(torch.ones(balancer.share, 4)).sum().backward()
        if step == 3 and rt.rank() == rt.size() - 1:
            raise RuntimeError(f"rank {rt.rank()} failed in step {step}")
        optimizer.step()
    print(f"rank {rt.rank()}: finished all {STEPS} steps", flush=True)
