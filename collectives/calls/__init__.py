"""The calls layer: each collective's call planned once for calls like it
(``_<collective>_plan``), then run over a memory by ``_<collective>_run``, which also
declares the collective's call forms (``_forms``); in program order, with its errors
named (``_calls``)."""
