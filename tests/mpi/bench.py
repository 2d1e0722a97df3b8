"""``ringtrain-bench`` under mpiexec: its arguments are this program's.

Run: mpiexec -n K python tests/mpi/bench.py allreduce -b 8 -e 64K
"""

import sys

from ringtrain.collectives.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
