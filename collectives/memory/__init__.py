"""The memory layer: where a collective's data lives while it runs: host arrays
(``_memory``), device memory through pinned host buffers or handed to a CUDA-aware MPI
(``_device_memory``, ``_staging``), and the choice between them (``_placement``)."""
