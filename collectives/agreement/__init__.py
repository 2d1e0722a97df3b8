"""The agreement layer: the per-call check that every rank made the same call (the
no-hang promise). ``_call`` is the call the ranks compare and its signature,
``_agreement`` the exchange of the headers, ``_resolution`` what follows a
disagreement, ``_carried`` the small collectives that ride in the check's messages,
``_checked`` the collectives made in the check's compiled call, and ``_name_matching``
the matching of named calls made by several threads."""
