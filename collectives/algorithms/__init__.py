"""The algorithms layer: each algorithm a schedule of messages over a group: the ring
(``_ring``, and ``_compiled_ring``, the ring and its check in one compiled call),
broadcast trees (``_broadcast_algorithms``), the node-aware ones (``_hierarchical``),
Adasum (``_adasum``), MPI's own (``_native``), the GPUs' CUDA IPC (``_ipc``); the choice
among them (``_selection``) and an allreduce's data phase (``_data_phase``)."""
