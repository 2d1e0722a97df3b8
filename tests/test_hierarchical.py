"""The hierarchical collectives: layouts and selection, pretend nodes on one machine, and
simulated hosts (network namespaces joined by veth links) where the machine allows them.

The simulated hosts come from ``simhosts.sh``, found through ``RINGTRAIN_SIMHOSTS`` or at
``../shared/tools/simhosts.sh`` beside the checkout; those tests skip when the script is
missing, when not root, when ``ip netns add`` is refused, or when hosts are already up
(one instance per machine). They always take the hosts down again.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpi_launch import ROOT, run_mpi
from ringtrain.collectives.algorithms._selection import (allreduce_algorithm, auto_choice,
                                                         broadcast_algorithm,
                                                         reducescatter_algorithm)
from ringtrain.collectives import tuning
from ringtrain.collectives.tuning import default_choice
from ringtrain.collectives.world._topology import NodeLayout
from ringtrain.collectives.config import Settings

TIMEOUT = 240.0


# --------------------------------------------------------------------------- layouts

def layout(*sizes: int) -> NodeLayout:
    nodes, start = [], 0
    for size in sizes:
        nodes.append(tuple(range(start, start + size)))
        start += size
    return NodeLayout(tuple(nodes), "test")


@pytest.mark.parametrize("sizes", [(1,), (2, 2), (2, 1), (3, 1), (1, 3), (2, 1, 2), (4, 3, 1)])
def test_every_chunk_has_one_owner_per_node(sizes):
    shape = layout(*sizes)
    assert shape.width == max(sizes)
    for node, members in enumerate(shape.nodes):
        firsts = [shape.first_chunk(node, i) for i in range(len(members))] + [shape.width]
        assert firsts[0] == 0
        assert all(a < b for a, b in zip(firsts, firsts[1:])), (sizes, node, firsts)
    if shape.uniform:
        assert all(shape.first_chunk(n, i) == i for n, m in enumerate(shape.nodes)
                   for i in range(len(m)))


def test_layout_description_and_node_of():
    shape = NodeLayout(((0, 2), (1,)), "node_size=2")
    assert shape.node_of == (0, 1, 0)
    assert shape.describe() == "2+1 (node_size=2)"
    assert not shape.uniform and shape.pays_off


@pytest.mark.parametrize("sizes, pays", [((4,), False), ((1, 1, 1), False), ((2, 2), True),
                                         ((2, 1), True)])
def test_auto_goes_hierarchical_only_across_nodes_and_above_the_threshold(sizes, pays):
    settings = Settings(hierarchical_min_bytes=1 << 20)
    shape = layout(*sizes)
    size = sum(sizes)
    big = allreduce_algorithm(None, 1 << 20, size, settings, "t", shape)
    # below the threshold: the built-in table's, but MPI's own for its ring between nodes
    flat = "native" if len(sizes) > 1 else default_choice("allreduce", 1 << 20, size, settings)
    assert big == ("hierarchical" if pays else flat)
    assert allreduce_algorithm(None, (1 << 20) - 1, size, settings, "t", shape) == flat
    assert broadcast_algorithm(None, 1 << 20, size, settings, "t", shape) == \
        ("hierarchical" if pays else "native")
    for forced in ("ring", "native", "node_leader"):
        assert allreduce_algorithm(forced, 1 << 20, size, settings, "t", shape) == forced
    assert allreduce_algorithm(None, 1 << 20, size, Settings(allreduce_algorithm="ring"), "t",
                               shape) == "ring"


@pytest.mark.parametrize("sizes", [(2,), (4,), (1, 1, 1), (2, 2)])
def test_larger_broadcasts_and_reducescatters_ride_in_the_agreement_only_on_one_node(sizes):
    settings = Settings(hierarchical_min_bytes=1 << 20)
    shape = layout(*sizes)
    size = sum(sizes)
    one_node = len(sizes) == 1
    for nbytes in (8 * 1024, tuning.FOLDED_CARRIED_BROADCAST_MAX_BYTES):
        assert broadcast_algorithm(None, nbytes, size, settings, "t", shape) == \
            ("recursive_doubling" if one_node else "native")
    assert broadcast_algorithm(None, tuning.SMALL_MESSAGE_BYTES, size, settings, "t",
                               shape) == "recursive_doubling"
    for nbytes in (tuning.CARRIED_BROADCAST_MAX_BYTES + 1, 1 << 20):
        assert broadcast_algorithm(None, nbytes, size, settings, "t", shape) == \
            ("hierarchical" if nbytes >= 1 << 20 and len(sizes) == 2 else "native")
    # an allreduce rides up to recursive_doubling_max_bytes anywhere
    assert allreduce_algorithm(None, 8 * 1024, size, settings, "t", shape) == \
        "recursive_doubling"
    scattered = reducescatter_algorithm(None, 8 * 1024, size, settings, "t", shape)
    assert scattered == ("recursive_doubling" if one_node else "native")
    assert reducescatter_algorithm(None, tuning.SMALL_MESSAGE_BYTES, size, settings, "t",
                                   shape) == "recursive_doubling"
    # the pairwise alltoall passes its blocks through the mailboxes of one node
    assert auto_choice("alltoall", 8 * 1024, size, settings, shape) == \
        ("pairwise" if one_node else "native")


def test_larger_calls_ride_only_where_the_agreement_passes_through_shared_memory():
    settings = Settings()
    without = NodeLayout(((0, 1, 2, 3),), "shared memory", shared_messages=False)
    assert broadcast_algorithm(None, 8 * 1024, 4, settings, "t", without) == "native"
    assert auto_choice("allgather", 8 * 1024, 4, settings, without) == "native"
    assert reducescatter_algorithm(None, 8 * 1024, 4, settings, "t", without) == "native"
    assert auto_choice("alltoall", 8 * 1024, 4, settings, without) == "native"
    assert auto_choice("alltoall", 8 * 1024, 4, settings, layout(4)) == "pairwise"
    assert auto_choice("allgather", 256 * 1024, 4, settings, without) == "native"
    assert auto_choice("allgather", 256 * 1024, 4, settings, layout(4)) == "pairwise"
    assert allreduce_algorithm(None, 8 * 1024, 4, settings, "t", without) == \
        "recursive_doubling"
    assert broadcast_algorithm(None, tuning.SMALL_MESSAGE_BYTES, 4, settings, "t",
                               without) == "recursive_doubling"


@pytest.mark.parametrize("sizes, pays", [((4,), False), ((1, 1, 1), False), ((2, 2), True),
                                         ((2, 1), True), ((3, 3, 3), True)])
def test_auto_gathers_and_scatters_hierarchically_only_across_nodes(sizes, pays):
    settings = Settings(hierarchical_min_bytes=1 << 20)
    shape = layout(*sizes)
    size = sum(sizes)
    gathered = auto_choice("allgather", 1 << 20, size, settings, shape)
    # the built-in table's pairwise exchange passes through the mailboxes of one node
    assert gathered == ("hierarchical" if pays else "native" if len(sizes) > 1 else
                        default_choice("allgather", 1 << 20, size, settings))
    assert auto_choice("allgather", (1 << 20) - 1, size, settings, shape) != "hierarchical"
    # reducescatter's columns need equal nodes: on others the ring moves the same data flat
    scattered = reducescatter_algorithm(None, 1 << 20, size, settings, "t", shape)
    if pays:
        assert scattered == ("hierarchical" if shape.uniform else "ring")
    else:
        assert scattered != "hierarchical"
    assert reducescatter_algorithm("hierarchical", 8, size, settings, "t", shape) == \
        ("hierarchical" if shape.uniform else "ring")
    assert reducescatter_algorithm("native", 1 << 20, size, settings, "t", shape) == "native"
    assert auto_choice("alltoall", 1 << 20, size, settings, shape) != "hierarchical"


# --------------------------------------------------------------------------- pretend nodes

@pytest.mark.processes
@pytest.mark.parametrize("nprocs, node_size", [(1, 2), (3, 2), (4, 2), (4, 3)],
                         ids=["np1", "np3-2+1", "np4-2+2", "np4-3+1"])
def test_pretend_nodes(nprocs, node_size):
    output = run_mpi("hierarchical", nprocs, timeout=TIMEOUT,
                     env={"RINGTRAIN_NODE_SIZE": str(node_size)})
    assert "all 13 checks passed" in output, output


# --------------------------------------------------------------------------- simulated hosts

def _simhosts_script() -> Path:
    configured = os.environ.get("RINGTRAIN_SIMHOSTS")
    script = Path(configured) if configured else ROOT.parent / "shared" / "tools" / "simhosts.sh"
    if not script.is_file():
        pytest.skip(f"simulated hosts unavailable: no {script} (set RINGTRAIN_SIMHOSTS)")
    return script


def _require_namespaces() -> None:
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (ip netns)")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"ip netns is unavailable: {listed.stderr.strip()}")
    if any(line.split()[0].startswith("rth") for line in listed.stdout.splitlines() if line):
        pytest.skip("simulated hosts are already up (one instance per machine); "
                    "if none is running, take them down with: simhosts.sh down")
    probe = f"rtprobe{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        pytest.skip(f"ip netns add refused: {added.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@contextlib.contextmanager
def simulated_hosts(count: int, ranks_per_host: list[int], workdir: Path
                    ) -> Iterator[dict[str, str]]:
    """Bring up ``count`` hosts; yield the environment that makes mpiexec place
    ``ranks_per_host[i]`` ranks on host i; always take the hosts down."""
    script = _simhosts_script()
    _require_namespaces()
    environment = {"SIMHOSTS_DIR": str(workdir), "SIMHOSTS_PYTHON": sys.executable}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(script), *args], capture_output=True, text=True,
                              env={**os.environ, **environment}, timeout=120)

    try:
        started = run("up", str(count))
        assert started.returncode == 0, f"simhosts up failed: {started.stderr}"
        exports = run("env", str(count), str(max(ranks_per_host)))
        assert exports.returncode == 0, exports.stderr
        for line in exports.stdout.splitlines():
            for item in line.removeprefix("export ").split():
                name, _, value = item.partition("=")
                environment[name] = value
        addresses = [line.split(":")[0] for line in
                     Path(environment["HYDRA_HOST_FILE"]).read_text().splitlines()]
        hostfile = workdir / "hosts"
        hostfile.write_text("".join(f"{address}:{n}\n"
                                    for address, n in zip(addresses, ranks_per_host)))
        environment["HYDRA_HOST_FILE"] = str(hostfile)
        environment["RINGTRAIN_NODE_SIZE"] = "0"
        yield environment
    finally:
        run("down")


@pytest.mark.processes
def test_two_hosts_of_two_ranks(tmp_path):
    with simulated_hosts(2, [2, 2], tmp_path) as environment:
        output = run_mpi("hierarchical", 4, timeout=TIMEOUT, env=environment)
        assert "layout 2+2 (shared memory)" in output, output
        assert "all 13 checks passed" in output
        output = run_mpi("hierarchical_hosts", 4, timeout=TIMEOUT, env=environment)
        assert "all 1 checks passed" in output, output


@pytest.mark.processes
def test_three_uneven_hosts(tmp_path):
    with simulated_hosts(3, [2, 1, 2], tmp_path) as environment:
        output = run_mpi("hierarchical", 5, timeout=TIMEOUT, env=environment)
        assert "layout 2+1+2 (shared memory)" in output, output
        assert "all 13 checks passed" in output
