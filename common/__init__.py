"""The leaves every layer of ringtrain shares, importing nothing of ringtrain's outside
this folder: the table of ``RINGTRAIN_*`` environment variables (:mod:`.environment`),
the exception hook and the rank's identity that the launcher installs in every rank, the
timeline's file format, the elastic resize protocol's marker files, and atomic file
writes. Standard library only, so the launcher reads them without importing MPI, numba
or torch."""
