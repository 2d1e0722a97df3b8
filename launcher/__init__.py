"""``ringtrain-run``: start a ringtrain job under the MPI that mpi4py uses.

``ringtrain-run -np 4 python train.py`` (or ``python -m ringtrain.launcher ...``) finds
the right ``mpiexec``, speaks its vendor's options, gives every rank sensible defaults,
prefixes output lines with the rank, and ends the whole job when one rank fails,
naming that rank. See docs/launcher.md.

Modules: ``cli`` (the command line), ``hosts`` (host lists), ``mpi_vendor`` (which
``mpiexec``, whose), ``command`` (the ``mpiexec`` argv per vendor), ``job`` (running
``mpiexec``, stopping a failed job), ``restart`` (restarting a failed job:
``--max-restarts``, host discovery), ``rank`` (the per-rank supervisor), ``rank_env``
(per-rank defaults), ``run_python`` (the user's Python program, under the exception hook
of :mod:`ringtrain.common.excepthook`), ``streams`` and ``report`` (output prefixes and exit
records), ``check_build`` and ``build_probe`` (``--check-build``).

This package never imports mpi4py or the other ringtrain packages at start-up
(importing ``mpi4py.MPI`` initializes MPI); only ``build_probe``, run in a subprocess
of its own, does.
"""
