"""docs/benchmarks.md's tables are the saved results' (benchmarks/tables.py), without MPI."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_tables():
    spec = importlib.util.spec_from_file_location("benchmark_tables",
                                                  ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tables = _load_tables()


def _part(time_us: float, ratio: float | None) -> dict:
    return {"time_us": time_us, "algbw": 0.0, "busbw": 0.0, "wrong": 0, "ratio": ratio}


def _save(folder: Path, collective: str = "allreduce", ranks: int = 2,
          in_place: bool = True, command: bool = True) -> Path:
    """A result file as ``ringtrain-bench --json`` writes it: 8 B and 64 MiB, auto and
    native."""
    rows = []
    for size, auto, native in ((8, 4.4, 2.2), (64 << 20, 20000.0, 25000.0)):
        for algorithm, seconds in (("auto", auto), ("native", native)):
            ratio = native / auto if algorithm == "auto" else 1.0
            rows.append({"size": size, "count": size // 4, "type": "float32",
                         "redop": "sum", "root": -1, "algorithm": algorithm,
                         "out_of_place": _part(seconds, ratio),
                         "in_place": _part(seconds / 2, ratio) if in_place else None})
    run = {"ringtrain-bench": f"{collective}, ringtrain 0.1.0",
           "MPI": "MPICH Version:      5.0.2", "machine": "AMD EPYC, 2 CPUs",
           "ranks": f"{ranks} on 1 node(s)", "buffers": "host memory (numpy), float32"}
    if command:
        run["command"] = f"ringtrain-bench {collective} -b 8 -e 64M -f 4 --algo auto,native"
    folder.mkdir(exist_ok=True)
    path = folder / f"{collective}-np{ranks}.json"
    path.write_text(json.dumps({"run": run, "rows": rows}))
    return path


def _doc(path: Path) -> Path:
    path.write_text(f"# Benchmarks\n\nBefore.\n\n{tables.BEGIN}\n\nold\n{tables.END}\n\nAfter.\n")
    return path


def test_the_reference_tables_are_the_saved_results():
    """docs/benchmarks.md holds exactly the tables of benchmarks/results/*.json."""
    assert tables.main(["--check"]) == 0


def test_a_table_per_collective_with_a_group_of_columns_per_rank_count(tmp_path):
    _save(tmp_path / "results", "broadcast", 4)
    _save(tmp_path / "results", "allreduce", 4)
    _save(tmp_path / "results", "allreduce", 2)
    _save(tmp_path / "results", "allgather", 2, in_place=False, command=False)
    found = tables.tables(tmp_path / "results")
    assert [(t.collective, t.ranks) for t in found] == \
        [("allreduce", 2), ("allreduce", 4), ("broadcast", 4), ("allgather", 2)]
    lines = tables.render(found).splitlines()
    assert [line for line in lines if line.startswith("### ")] == \
        ["### allreduce", "### broadcast", "### allgather"]
    assert ("| size | 2 ranks: `auto` µs | `native` µs | xnative | xnative in place "
            "| 4 ranks: `auto` µs | `native` µs | xnative | xnative in place |") in lines
    assert "| 8 B | 4.40 | 2.20 | 0.50 | 0.50 | 4.40 | 2.20 | 0.50 | 0.50 |" in lines
    assert "| 64 MiB | 20000 | 25000 | 1.25 | 1.25 | 20000 | 25000 | 1.25 | 1.25 |" in lines
    assert "| size | 2 ranks: `auto` µs | `native` µs | xnative |" in lines   # no in place
    assert ("`mpiexec -n 2 ringtrain-bench allreduce -b 8 -e 64M -f 4 --algo auto,native` "
            "(ranks: 2 on 1 node(s)); `mpiexec -n 4 ringtrain-bench allreduce -b 8 -e 64M "
            "-f 4 --algo auto,native` (ranks: 4 on 1 node(s)); machine: AMD EPYC, 2 CPUs; "
            "MPI: MPICH Version: 5.0.2; ringtrain 0.1.0; buffers: host memory (numpy), "
            "float32.") in lines
    assert any(line.startswith("`mpiexec -n 2 ringtrain-bench allgather -b 8 -e 64M -f "
                               "8388608 --algo auto,native --json benchmarks/results/"
                               "allgather-np2.json`") for line in lines)


def test_sizes_one_rank_count_lacks_leave_its_cells_empty(tmp_path):
    _save(tmp_path / "results", "alltoall", 2, in_place=False)
    path = _save(tmp_path / "results", "alltoall", 4, in_place=False)
    recorded = json.loads(path.read_text())
    for row in recorded["rows"]:
        if row["size"] == 8:
            row["size"] = 0                 # 8 B split among 4 ranks: nothing moves
    path.write_text(json.dumps(recorded))
    lines = tables.render(tables.tables(tmp_path / "results")).splitlines()
    assert "| 8 B | 4.40 | 2.20 | 0.50 |  |  |  |" in lines
    assert not any(line.startswith("| 0 B") for line in lines)


def test_write_then_check_and_a_changed_number_fails(tmp_path, capsys):
    _save(tmp_path / "results")
    doc = _doc(tmp_path / "doc.md")
    arguments = ["--results", str(tmp_path / "results"), "--doc", str(doc)]
    assert tables.main(arguments + ["--check"]) == 1
    assert tables.main(arguments + ["--write"]) == 0
    written = doc.read_text()
    assert written.startswith("# Benchmarks\n\nBefore.\n\n") and written.endswith("After.\n")
    assert "old" not in written and "| 8 B | 4.40 |" in written
    assert tables.main(arguments + ["--check"]) == 0
    doc.write_text(written.replace("| 8 B | 4.40 |", "| 8 B | 4.10 |"))
    capsys.readouterr()
    assert tables.main(arguments + ["--check"]) == 1
    assert "--write" in capsys.readouterr().err


def test_no_results_say_so(tmp_path):
    doc = _doc(tmp_path / "doc.md")
    arguments = ["--results", str(tmp_path / "none"), "--doc", str(doc)]
    assert tables.main(arguments + ["--write"]) == 0
    assert tables.NO_RESULTS in doc.read_text()
    assert tables.main(arguments + ["--check"]) == 0


@pytest.mark.parametrize("name, message", [
    ("allreduce-2.json", "not named"),
    ("broadcast-np2.json", "measured 'allreduce'"),
    ("allreduce-np4.json", "its name says 4"),
])
def test_a_file_that_does_not_match_its_name_is_refused(tmp_path, name, message, capsys):
    _save(tmp_path / "results").rename(tmp_path / "results" / name)
    doc = _doc(tmp_path / "doc.md")
    assert tables.main(["--results", str(tmp_path / "results"), "--doc", str(doc),
                        "--write"]) == 2
    assert message in capsys.readouterr().err


def test_a_document_without_markers_is_refused(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("# nothing here\n")
    assert tables.main(["--results", str(tmp_path), "--doc", str(doc), "--check"]) == 2
    assert "has no" in capsys.readouterr().err
