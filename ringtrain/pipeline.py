"""``ringtrain.pipeline``: pipeline-parallel training for PyTorch, with data parallelism
across pipelines (see :mod:`ringtrain.trainer.pipeline`)."""

from ringtrain.trainer.pipeline import PipelineLayout, PipelineTrainer
from ringtrain.trainer.pipeline_schedule import (SCHEDULES, bubble_fraction, peak_in_flight,
                                                 schedule)
from ringtrain.trainer.pipeline_split import (automatic_split, balanced_split,
                                              measured_costs, parameter_costs)

__all__ = ["PipelineTrainer", "PipelineLayout", "SCHEDULES", "schedule", "peak_in_flight",
           "bubble_fraction", "automatic_split", "balanced_split", "measured_costs",
           "parameter_costs"]
