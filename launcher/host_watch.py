"""Watching the host discovery script while a job runs.

A :class:`HostWatcher` runs the script every ``--discovery-interval`` seconds on a thread
of the launcher. When the hosts it offers (less those cooling down after a failure) give
another placement than the running job's, the watcher writes the notice that the ranks
look for at their next commit (:data:`ringtrain.common.resize_protocol.HOSTS_UPDATED`), and
removes it if the hosts change back before the job stops. A script that fails, or offers
fewer slots than ``--min-np``, changes nothing: the job keeps its ranks.
"""

from __future__ import annotations

import threading
import time

from ..common.resize_protocol import HOSTS_UPDATED, clear, path_in
from .restart import (Blacklist, DiscoveryError, ElasticOptions, NotEnoughRanks, Placement,
                      discover_hosts, place_on_discovered_hosts)


class HostWatcher:
    """Polls the discovery script during one start of the job.

    Args:
        options: the launcher's restart settings (the script, the interval, the limits).
        blacklist: the hosts cooling down after a failure.
        running: the placement of the running job.
        directory: the job's elastic directory, where the notice goes.
        restart: the number of the running start (``RINGTRAIN_RESTART_COUNT`` for the script).
    """

    def __init__(self, options: ElasticOptions, blacklist: Blacklist, running: Placement,
                 directory: str, restart: int):
        assert options.discovery_script is not None
        self.options = options
        self.blacklist = blacklist
        self.running = running
        self.directory = directory
        self.restart = restart
        self.changed: Placement | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ringtrain-host-watch",
                                        daemon=True)

    def start(self) -> HostWatcher:
        """Start polling; returns itself."""
        self._thread.start()
        return self

    def stop(self) -> Placement | None:
        """Stop polling; the placement the hosts gave last, when it differs from the
        running job's (else None)."""
        self._stop.set()
        self._thread.join()
        return self.changed

    def poll(self) -> None:
        """Run the script once and write or remove the notice."""
        try:
            hosts = discover_hosts(self.options.discovery_script, self.restart)
            placement = place_on_discovered_hosts(hosts, self.options, self.blacklist,
                                                  time.monotonic())
        except (DiscoveryError, NotEnoughRanks):
            return
        if placement == self.running:
            self.changed = None
            clear(self.directory, HOSTS_UPDATED)
        elif placement != self.changed:
            self.changed = placement
            path = path_in(self.directory, HOSTS_UPDATED)
            with open(path, "w", encoding="utf-8") as notice:
                notice.write(f"{placement.describe()}\n")

    def _watch(self) -> None:
        while not self._stop.wait(self.options.discovery_interval):
            self.poll()
