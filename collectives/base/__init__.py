"""The base layer: what every collective's code stands on and that knows nothing of
MPI's communicators: the group of ranks an algorithm runs over (``_group``), ops and
dtypes (``_ops``), the caller's tensors as buffers (``_buffers``, ``_checks``), the order
of calls (``_executor``), the activity record the stall inspector and the timeline read
(``_activity``, ``_tracing``), the finishing step of a result (``_finishing``) and the pool
of large results (``_result_pool``). With the public leaves beside this package
(``errors``, ``config``, ``logs``, ``timeline``, ``tuning``, ``cuda_aware``,
``gpu_choice``), it imports nothing else of the collectives."""
