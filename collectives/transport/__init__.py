"""The transport layer: how bytes move between ranks, below any algorithm's choice: MPI's C
functions (and the clock) called by symbol from compiled code (``_c_calls``), the node's
shared-memory mailboxes (``_mailboxes``) and the pairwise exchange through them
(``_pairwise``), the recursive-doubling exchange (``_recursive_doubling``), the compiled
exchanges that carry the agreement (``_compiled_steps``), the small collectives riding
in it (``_compiled_riding``) and the MPI collectives made once it has passed
(``_compiled_checked``), set up per group by ``_compiled_exchange``; and the
point-to-point communicators (``_p2p_channels``)."""
