"""The point-to-point layer: a message's header (``_p2p_header``), its protocol as a
state machine (``_p2p_protocol``) and in compiled code (``_p2p_compiled``), plans kept
for blocking calls (``_p2p_plans``), and the progress loop that moves every message in
flight (``_p2p_progress``). The public calls are in ``collectives._point_to_point``."""
