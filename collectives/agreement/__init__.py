"""The agreement layer: the per-call check that every rank made the same call (the
no-hang promise), with the collectives small enough to ride in its messages
(``_agreement``), and the matching of named calls made by several threads
(``_name_matching``)."""
