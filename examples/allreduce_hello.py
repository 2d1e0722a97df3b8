"""A first ringtrain program: average an array over all ranks.

    mpiexec -n 2 python examples/allreduce_hello.py
"""

import numpy as np

import ringtrain as rt


def main() -> None:
    """Average a per-rank array, broadcast a value, and print what rank 0 sees."""
    rt.init()
    gradient = np.full(4, float(rt.rank()), dtype=np.float32)
    average = rt.allreduce(gradient, name="gradient")  # op defaults to Average
    expected = np.full(4, (rt.size() - 1) / 2, dtype=np.float32)
    assert np.allclose(average, expected), (average, expected)

    learning_rate = rt.broadcast_object(0.1 if rt.rank() == 0 else None, root_rank=0)
    if rt.rank() == 0:
        print(f"{rt.size()} ranks: average gradient {average}, learning rate {learning_rate}")
    rt.shutdown()


if __name__ == "__main__":
    main()
