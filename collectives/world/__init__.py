"""The world layer: ringtrain's communicator and what hangs on it: ``init`` and
``shutdown`` (``_world``), process sets (``_process_sets``), the ranks' nodes
(``_topology``), the tuning table agreed at start (``_tuning_load``), the stall inspector
(``_stall``), the job's timeline files (``_timeline_job``), and the plans kept per process
set (``_plan_cache``)."""
