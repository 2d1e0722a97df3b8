"""``ringtrain.elastic``: restart-based elastic training (see :mod:`ringtrain.trainer.elastic`)."""

from ringtrain.trainer.elastic import (CHECKPOINT_NAME, ELASTIC_DIR_VARIABLE,
                                       RESTART_COUNT_VARIABLE, ElasticError, HostsChanged,
                                       State, restart_count, run, write_atomically)

__all__ = ["State", "run", "restart_count", "write_atomically", "ElasticError", "HostsChanged",
           "ELASTIC_DIR_VARIABLE", "RESTART_COUNT_VARIABLE", "CHECKPOINT_NAME"]
