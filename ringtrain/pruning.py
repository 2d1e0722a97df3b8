"""``ringtrain.pruning``: gradual pruning with masks agreed across ranks (see
:mod:`ringtrain.trainer.pruning`)."""

from ringtrain.trainer.pruning import PRUNABLE_LAYERS, Pruner
from ringtrain.trainer.pruning_masks import METHODS, SCOPES, compute_masks
from ringtrain.trainer.pruning_schedule import GradualSchedule

__all__ = ["Pruner", "GradualSchedule", "compute_masks", "METHODS", "SCOPES",
           "PRUNABLE_LAYERS"]
