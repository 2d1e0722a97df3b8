"""The calls layer: a collective call as a plan kept for calls like it (``_plans``), run
over a memory (``_allreduce_run``), in program order with its errors named
(``_calls``)."""
