"""The ``ringtrain-run`` launcher: not yet written.

This package must never import mpi4py or the other ringtrain packages at start-up.
"""
