"""Tuning tables: the file format, ``auto`` choosing by the table in force, what init
does with a malformed, foreign or differing file, and ``ringtrain-bench --tune`` on real
ranks (tests/mpi/tuning.py at 1, 2 and 3 ranks)."""

from __future__ import annotations

import json
import warnings

import pytest

from ringtrain.collectives import MismatchError, tuning
from ringtrain.collectives.algorithms._selection import (allreduce_algorithm, auto_choice,
                                                         broadcast_algorithm,
                                                         reducescatter_algorithm)
from ringtrain.collectives.world._tuning_load import Found, agree_on_table
from ringtrain.collectives.bench.tune import candidates, ranges_of, tuned_sizes, winner
from ringtrain.collectives.config import Settings
from ringtrain.collectives.tuning import (Range, TableError, TuningTable, default_choice, key_of,
                                          parse_table)
from ringtrain.common.environment import tuning_file

from mpi_launch import run_checks

KEY = key_of("MPICH Version: 5.0.2", [0, 0, 2, 2])  # two nodes of two ranks
SETTINGS = Settings()
TABLE = TuningTable(KEY, {4: {
    "allreduce": (Range(64, "ring", 1024), Range(4096, "native"),
                  Range(65536, "recursive_doubling", 1024)),
    "broadcast": (Range(100, "pipeline", 1024), Range(1 << 20, "native")),
    "allgather": (Range(1000, "native"), Range(1 << 20, "ring", 1024)),
    "alltoall": (Range(1 << 20, "pairwise", 1024),),
}}, "ringtrain-bench --tune")


@pytest.fixture
def table():
    tuning.install(TABLE)
    yield TABLE
    tuning.install(None)


def test_a_table_survives_its_file_format():
    assert KEY.nodes == 2 and KEY.ranks_per_node == 2 and KEY.world_size == 4
    text = TABLE.dumps()
    assert parse_table(text) == TABLE
    assert json.loads(text)["groups"]["4"]["allgather"][0] == {"max_bytes": 1000,
                                                               "algorithm": "native"}
    uneven = key_of("lib", [0, 0, 0, 3])
    assert uneven.ranks_per_node == (3, 1)
    assert parse_table(TuningTable(uneven, {}).dumps()).key == uneven


def test_auto_follows_the_table_for_the_sizes_and_group_sizes_it_covers(table):
    chosen = [allreduce_algorithm(None, n, 4, SETTINGS, "t") for n in (8, 64, 65, 4096, 4097,
                                                                         65536)]
    assert chosen == ["ring", "ring", "native", "native", "recursive_doubling",
                      "recursive_doubling"]
    assert broadcast_algorithm(None, 100, 4, SETTINGS, "t") == "pipeline"
    assert broadcast_algorithm(None, 101, 4, SETTINGS, "t") == "native"
    assert auto_choice("allgather", 1000, 4, SETTINGS) == "native"
    assert auto_choice("allgather", 1001, 4, SETTINGS) == "ring"
    assert auto_choice("alltoall", 8, 4, SETTINGS) == "pairwise"
    # beyond the ranges, another group size, a collective the table lacks: the defaults
    for collective, nbytes, size in (("allreduce", 65537, 4), ("allreduce", 8, 3),
                                     ("alltoall", (1 << 20) + 1, 4),
                                     ("reducescatter", 8, 4)):
        assert tuning.choose(collective, nbytes, size, SETTINGS) == \
            default_choice(collective, nbytes, size, SETTINGS)
    assert reducescatter_algorithm(None, 8, 4, SETTINGS, "t") == \
        default_choice("reducescatter", 8, 4, SETTINGS)


def test_the_call_and_the_settings_override_the_table(table):
    assert allreduce_algorithm("native", 8, 4, SETTINGS, "t") == "native"
    assert allreduce_algorithm(None, 8, 4, Settings(allreduce_algorithm="recursive_doubling"),
                               "t") == "recursive_doubling"
    assert broadcast_algorithm("binomial", 100, 4, SETTINGS, "t") == "binomial"
    assert reducescatter_algorithm(None, 8, 4, Settings(reducescatter_algorithm="ring"),
                                   "t") == "ring"


def test_the_built_in_allreduce_ring_is_for_one_node_and_mpi_takes_over_between_nodes():
    from test_hierarchical import layout
    above = SETTINGS.recursive_doubling_max_bytes + 1
    assert allreduce_algorithm(None, above, 4, SETTINGS, "t", layout(4)) == "ring"
    assert allreduce_algorithm(None, above, 4, SETTINGS, "t", layout(2, 2)) == "native"
    assert allreduce_algorithm(None, above, 2, SETTINGS, "t", layout(1, 1)) == "native"
    assert allreduce_algorithm(None, SETTINGS.hierarchical_min_bytes, 4, SETTINGS, "t",
                               layout(2, 2)) == "hierarchical"
    big = tuning.CARRIED_REDUCESCATTER_MAX_BYTES + 1
    assert reducescatter_algorithm(None, big, 4, SETTINGS, "t", layout(4)) == "ring"
    # the reduce-scatter's ring stays between nodes (MPI's own was slower there)
    assert reducescatter_algorithm(None, big, 4, SETTINGS, "t", layout(2, 2)) == "ring"
    assert reducescatter_algorithm(None, big, 2, SETTINGS, "t", layout(1, 1)) == "ring"
    assert reducescatter_algorithm(None, big, 4, SETTINGS, "t") == "ring"  # layout unknown


def test_a_tuned_hierarchical_range_needs_ranks_on_several_nodes():
    from test_hierarchical import layout
    tuning.install(TuningTable(KEY, {4: {"allreduce": (Range(None, "hierarchical"),)}}))
    try:
        assert allreduce_algorithm(None, 8, 4, SETTINGS, "t", layout(2, 2)) == "hierarchical"
        assert allreduce_algorithm(None, 8, 4, SETTINGS, "t", layout(4)) == \
            default_choice("allreduce", 8, 4, SETTINGS)
    finally:
        tuning.install(None)


def test_the_built_in_table_keeps_small_messages_and_takes_the_ring_or_mpi_above():
    assert tuning.installed() is None
    small, big = tuning.SMALL_MESSAGE_BYTES, tuning.SMALL_MESSAGE_BYTES + 1
    doubling = SETTINGS.recursive_doubling_max_bytes
    assert doubling == 128 * 1024  # the payload rides in the agreement's messages
    for ranks in (2, 3, 4):
        assert default_choice("allreduce", doubling, ranks, SETTINGS) == "recursive_doubling"
        assert default_choice("allreduce", doubling + 1, ranks, SETTINGS) == "ring"
        assert default_choice("allreduce", 1 << 30, ranks, SETTINGS) == "ring"
    assert default_choice("broadcast", small, 2, SETTINGS) == "recursive_doubling"
    assert default_choice("broadcast", small, 4,
                          Settings(broadcast_pipeline_min_bytes=1024)) == "pipeline"
    assert default_choice("alltoall", small, 3, SETTINGS) == "recursive_doubling"
    for ranks, pairwise in ((2, tuning.PAIRWISE_ALLTOALL_MAX_BYTES),
                            (3, tuning.WIDE_PAIRWISE_ALLTOALL_MAX_BYTES),
                            (4, tuning.WIDE_PAIRWISE_ALLTOALL_MAX_BYTES)):
        assert default_choice("alltoall", big, ranks, SETTINGS) == "pairwise"
        assert default_choice("alltoall", pairwise, ranks, SETTINGS) == "pairwise"
        assert default_choice("alltoall", pairwise + 1, ranks, SETTINGS) == "native"
    for ranks in (2, 3, 4):
        gathered = tuning.CARRIED_ALLGATHER_MAX_BYTES
        assert default_choice("allgather", gathered, ranks, SETTINGS) == "recursive_doubling"
        assert default_choice("allgather", gathered + 1, ranks, SETTINGS) == "pairwise"
        pairwise = tuning.PAIRWISE_ALLGATHER_MAX_BYTES if ranks == 2 else \
            tuning.WIDE_PAIRWISE_ALLGATHER_MAX_BYTES
        assert default_choice("allgather", pairwise, ranks, SETTINGS) == "pairwise"
        assert default_choice("allgather", pairwise + 1, ranks, SETTINGS) == "native"
    for ranks, carried in ((2, tuning.PAIR_CARRIED_BROADCAST_MAX_BYTES),
                           (3, tuning.FOLDED_CARRIED_BROADCAST_MAX_BYTES),
                           (4, tuning.CARRIED_BROADCAST_MAX_BYTES),
                           (6, tuning.FOLDED_CARRIED_BROADCAST_MAX_BYTES)):
        assert default_choice("broadcast", carried, ranks, SETTINGS) == "recursive_doubling"
        assert default_choice("broadcast", carried + 1, ranks, SETTINGS) == "native"
    for ranks, carried in ((2, tuning.PAIR_CARRIED_REDUCESCATTER_MAX_BYTES),
                           (3, tuning.CARRIED_REDUCESCATTER_MAX_BYTES),
                           (4, tuning.CARRIED_REDUCESCATTER_MAX_BYTES)):
        assert default_choice("reducescatter", carried, ranks, SETTINGS) == \
            "recursive_doubling"
        assert default_choice("reducescatter", carried + 1, ranks, SETTINGS) == "ring"
        assert default_choice("reducescatter", 1 << 30, ranks, SETTINGS) == "ring"
        assert default_choice("allgather", 1 << 30, ranks, SETTINGS) == "native"
    # the recursive-doubling setting still reaches above the small messages
    assert default_choice("allreduce", 1 << 20,
                          4, Settings(recursive_doubling_max_bytes=1 << 20)) == \
        "recursive_doubling"


@pytest.mark.parametrize("change, why", [
    (lambda d: d.update(format="ringtrain-tuning/0"), "format"),
    (lambda d: d["key"].pop("world_size"), "key.world_size"),
    (lambda d: d["groups"].update({"two": {}}), "group size 'two'"),
    (lambda d: d["groups"]["4"].update(allreduce=[{"max_bytes": 8, "algorithm": "tree"}]),
     "algorithm 'tree'"),
    (lambda d: d["groups"]["4"].update(alltoall=[{"max_bytes": 8, "algorithm": "auto"}]),
     "algorithm 'auto'"),
    (lambda d: d["groups"]["4"].update(allgather=[{"max_bytes": 64, "algorithm": "ring"},
                                                  {"max_bytes": 64, "algorithm": "native"}]),
     "does not exceed"),
    (lambda d: d["groups"]["4"].update(allgather=[{"max_bytes": None, "algorithm": "ring"},
                                                  {"max_bytes": 64, "algorithm": "native"}]),
     "only the last range"),
    (lambda d: d["groups"]["4"].update(gather=[]), "unknown collective"),
    (lambda d: d["groups"]["4"]["broadcast"][0].update(max_bytes=-1), "max_bytes"),
])
def test_a_malformed_table_is_refused_naming_what_is_wrong(change, why):
    document = TABLE.to_json()
    change(document)
    with pytest.raises(TableError, match=why):
        parse_table(json.dumps(document))
    with pytest.raises(TableError, match="not JSON"):
        parse_table("{")


def _found(path, text):
    data = text.encode()
    return Found(path, f"sha256 {tuning.digest(data)}", data)


def test_init_uses_a_table_every_rank_found_alike(tmp_path):
    mine = _found("/t.json", TABLE.dumps())
    try:
        assert agree_on_table(mine, [mine.exchanged] * 4, KEY) == TABLE
        assert tuning.installed() == TABLE
    finally:
        tuning.install(None)


@pytest.mark.parametrize("text, why", [
    ("not json", "malformed: not JSON"),
    (TuningTable(key_of("MPICH Version: 5.0.2", [0, 0, 0, 0]), {}).dumps(),
     "tuned for another job: nodes 1, this job 2; ranks_per_node 4, this job 2"),
    (TuningTable(key_of("Open MPI v5", [0, 0, 2, 2]), {}).dumps(),
     "mpi_library 'Open MPI v5', this job 'MPICH Version: 5.0.2'"),
])
def test_a_malformed_or_foreign_table_is_ignored_with_one_warning(text, why):
    mine = _found("/t.json", text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert agree_on_table(mine, [mine.exchanged] * 4, KEY) is None
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "ignoring the tuning file /t.json" in messages[0] \
        and why in messages[0], messages
    assert tuning.installed() is None


def test_ranks_that_found_different_files_get_a_mismatch_naming_them():
    mine = _found("/a.json", TABLE.dumps())
    other = _found("/b.json", TABLE.dumps() + " ")
    everyone = [mine.exchanged, mine.exchanged, other.exchanged, ("/a.json", "missing")]
    with pytest.raises(MismatchError) as caught:
        agree_on_table(mine, everyone, KEY)
    message = str(caught.value)
    assert "rank 2 sent tuning file '/b.json'" in message
    assert "rank 3 sent contents 'missing'" in message
    assert f"ranks 0,1 sent contents '{mine.identity}'" in message
    assert caught.value.differences["tuning file"][3] == "/a.json"
    assert tuning.installed() is None


def test_the_tuning_file_defaults_to_the_cache_directory(tmp_path):
    assert tuning_file({"XDG_CACHE_HOME": "/c"}) == "/c/ringtrain/tuning.json"
    assert tuning_file({"HOME": str(tmp_path)}).endswith(".cache/ringtrain/tuning.json")
    assert tuning_file({"RINGTRAIN_TUNING_FILE": "/x.json"}) == "/x.json"
    assert tuning_file({"RINGTRAIN_TUNING_FILE": ""}) is None


def test_tune_measures_every_algorithm_and_merges_equal_winners():
    assert tuned_sizes(8, 64 << 20, 4)[-1] == 64 << 20
    assert tuned_sizes(8, 64 << 20, 4)[0] == 16
    assert tuned_sizes(1024, 4096, 2) == (1024, 2048, 4096)
    assert candidates("allreduce", False) == ("ring", "recursive_doubling", "native")
    assert "node_leader" in candidates("allreduce", True)
    assert candidates("alltoall", True) == ("recursive_doubling", "pairwise", "native")
    assert "hierarchical" in candidates("reducescatter", True)
    assert "hierarchical" not in candidates("reducescatter", False)
    assert ranges_of([(16, "ring"), (64, "ring"), (256, "native"), (1024, "ring")], 512) == (
        Range(64, "ring", 512), Range(256, "native"), Range(1024, "ring", 512))
    seconds = {"ring": 1.0, "native": 1.04, "recursive_doubling": 2.0}
    assert winner(seconds, "native", 0.05) == "native"  # within the tolerance
    assert winner(seconds, "native", 0.01) == "ring"
    assert winner(seconds, "recursive_doubling", 0.05) == "ring"


@pytest.mark.processes
@pytest.mark.parametrize("nprocs", [1, 2, 3], ids=["np1", "np2", "np3"])
def test_tables_on_real_ranks(nprocs):
    run_checks("tuning", nprocs, 6, timeout=180)
