"""Training-loop integration (DistributedOptimizer, gradient buckets): not yet written."""
