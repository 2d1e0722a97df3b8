"""``ringtrain.balance``: shares of the global batch that follow each rank's measured
speed (see :mod:`ringtrain.trainer.balance`)."""

from ringtrain.trainer.balance import BalanceError, LoadBalancer, scale_loss
from ringtrain.trainer.balance_shares import (balanced_shares, predicted_step_seconds,
                                              proportional_shares, split_batch)
from ringtrain.trainer.balanced_sampler import BalancedBatchSampler

__all__ = ["LoadBalancer", "BalancedBatchSampler", "BalanceError", "scale_loss",
           "balanced_shares", "proportional_shares", "split_batch", "predicted_step_seconds"]
