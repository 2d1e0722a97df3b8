"""ringtrain-bench: size parsing, bandwidth formulas, output format, and real runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpi_launch import run_mpi
from ringtrain.collectives.bench import cases, report
from ringtrain.collectives.bench.measure import INJECT_WRONG_VARIABLE
from ringtrain.collectives.bench.options import parse_options, sizes_between

COLLECTIVES = ["allreduce", "broadcast", "allgather", "reducescatter", "alltoall"]


# --------------------------------------------------------------------------- options

def test_sizes_between_steps_by_the_factor_inclusively():
    assert sizes_between(8, 64, 2) == (8, 16, 32, 64)
    assert sizes_between(8, 100, 4) == (8, 32)
    assert sizes_between(1 << 20, 1 << 20, 2) == (1 << 20,)


@pytest.mark.parametrize("minimum, maximum, factor", [(0, 8, 2), (16, 8, 2), (8, 64, 1)])
def test_sizes_between_refuses_bad_ranges(minimum, maximum, factor):
    with pytest.raises(ValueError):
        sizes_between(minimum, maximum, factor)


def test_size_suffixes_are_binary_units():
    options = parse_options(["allreduce", "-b", "1K", "-e", "4M", "-f", "4"])
    assert options.sizes == (1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


def test_defaults_and_datatype_names():
    options = parse_options(["broadcast", "-d", "half", "-r", "1"])
    assert options.dtype == np.float16 and options.root == 1
    assert options.algorithms == ("auto", "native") and options.check
    assert parse_options(["allgather", "-d", "double"]).dtype == np.float64
    assert parse_options(["allgather", "-d", "int8", "--algo", "ring"]).algorithms == ("ring",)


@pytest.mark.parametrize("argv, message", [
    (["allreduce", "-b", "0"], "minbytes"),
    (["allreduce", "-b", "12X"], "not a size"),
    (["allreduce", "--algo", "pipeline"], "offers the algorithms"),
    (["allgather", "--algo", "recursive_doubling"], "offers the algorithms"),
    (["allreduce", "-o", "avg", "-d", "int32"], "avg needs a floating"),
    (["broadcast", "--compression", "fp16"], "--compression applies"),
    (["allreduce", "--compression", "bf16", "-o", "prod"], "not prod"),
    (["allreduce", "--device", "cuda"], "host (numpy) buffers"),
    (["allreduce", "-n", "0"], "--iters"),
    (["gather"], "invalid choice"),
])
def test_bad_arguments_exit_with_status_2_and_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_options(argv)
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines()
                   if line.startswith("ringtrain-bench: error")]
    assert len(error_lines) == 1 and message in error_lines[0], error_lines


# --------------------------------------------------------------------------- formulas

@pytest.mark.parametrize("ranks, factors", [
    (1, {"allreduce": 0.0, "broadcast": 1.0, "allgather": 0.0}),
    (2, {"allreduce": 1.0, "broadcast": 1.0, "allgather": 0.5, "reducescatter": 0.5,
         "alltoall": 0.5}),
    (4, {"allreduce": 1.5, "broadcast": 1.0, "allgather": 0.75, "reducescatter": 0.75,
         "alltoall": 0.75}),
])
def test_bus_factors_are_those_of_nccl_tests(ranks, factors):
    for collective, factor in factors.items():
        assert cases.bus_factor(collective, ranks) == pytest.approx(factor)


def test_element_counts_round_down_to_equal_parts_where_ranks_own_parts():
    assert cases.element_count("allreduce", 1000, 4, 3) == 250
    assert cases.element_count("broadcast", 10, 4, 3) == 2
    for collective in ("allgather", "reducescatter", "alltoall"):
        assert cases.element_count(collective, 1000, 4, 3) == 249
        assert cases.element_count(collective, 8, 4, 3) == 0


def test_bandwidths_and_ratio():
    part = report.result(nbytes=4_000_000, seconds=0.002, factor=1.5, wrong=0,
                         baseline_busbw=1.5)
    assert part.time_us == pytest.approx(2000.0)
    assert part.algbw == pytest.approx(2.0)  # GB = 1e9 bytes
    assert part.busbw == pytest.approx(3.0)
    assert part.ratio == pytest.approx(2.0)
    assert report.result(8, 1e-6, 1.0, None, None).ratio is None


def test_check_input_makes_every_reduction_exact_in_every_dtype():
    for op in ("sum", "prod", "max", "min"):
        values = [cases.check_input(r, 1000, np.float16, op) for r in range(4)]
        assert all(np.all(v == cases.check_input(r, 1000, np.int8, op))
                   for r, v in enumerate(values))
    assert cases.check_input(3, 4, np.int8, "prod").max() <= 2


# --------------------------------------------------------------------------- output

def parse_table(output: str) -> list[dict]:
    """The data lines of the table, as dicts of the out-of-place and in-place columns."""
    rows = []
    for line in output.splitlines():
        if line.startswith("#") or not line.strip() or not line.strip()[0].isdigit():
            continue
        fields = line.split()
        assert len(fields) in (14, 16), f"unexpected columns: {line!r}"
        ratio = len(fields) == 16
        width = 5 if ratio else 4
        rows.append({
            "size": int(fields[0]), "count": int(fields[1]), "type": fields[2],
            "redop": fields[3], "root": int(fields[4]), "algo": fields[5],
            "oop": fields[6:6 + width], "ip": fields[6 + width:6 + 2 * width],
        })
    return rows


def test_row_and_header_columns_line_up():
    part = report.result(4096, 1e-5, 1.0, 0, 2.0)
    row = report.Row(4096, 1024, "float32", "sum", -1, "ring", part, None)
    header = report.header_lines({"MPI": "test"}, with_ratio=True)
    line = report.format_row(row, with_ratio=True)
    titles = header[-1]
    assert len(line) == len(titles)
    assert titles.index("algo") + len("algo") == line.index("ring") + len("ring")
    assert "n/a" in line and header[0] == "# MPI: test"


# --------------------------------------------------------------------------- real runs

@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_real_run_checks_results_and_prints_parseable_columns(collective, nprocs, tmp_path):
    algorithms = {"allreduce": "auto,ring,recursive_doubling,native",
                  "broadcast": "pipeline,binomial,native"}.get(collective, "auto,native")
    csv_path, json_path = tmp_path / "out.csv", tmp_path / "out.json"
    output = run_mpi("bench", nprocs, collective, "-b", "8", "-e", "128K", "-f", "16",
                     "-n", "2", "-w", "1", "--rounds", "1", "-d", "int32", "-o", "max",
                     "-r", str(nprocs - 1), "--algo", algorithms,
                     "--csv", str(csv_path), "--json", str(json_path), timeout=240)
    rows = parse_table(output)
    sizes = [8, 128, 2048, 32768]
    assert len(rows) == len(sizes) * len(algorithms.split(","))
    for row in rows:
        assert row["type"] == "int32" and row["oop"][3] == "0", row
        assert row["ip"][3] == ("0" if collective in ("allreduce", "broadcast") else "n/a")
        assert row["algo"] in algorithms.split(",")
        if row["algo"] == "native":
            assert row["oop"][4] == ("1.00" if row["count"] else "-"), row
    assert "# Out of bounds values : 0 OK" in output
    assert f"{nprocs} on 1 node(s)" in output
    assert output.count("# Avg bus bandwidth") == len(algorithms.split(","))
    recorded = json.loads(json_path.read_text())
    assert len(recorded["rows"]) == len(rows) and "MPI" in recorded["run"]
    assert len(csv_path.read_text().splitlines()) == len(rows) + 1


def test_compressed_allreduce_and_floating_average_check_out():
    output = run_mpi("bench", 2, "allreduce", "-b", "1K", "-e", "64K", "-f", "8",
                     "-n", "2", "-w", "1", "--rounds", "1", "-o", "avg",
                     "--compression", "fp16", "--algo", "ring,native", timeout=240)
    assert "fp16 compression" in output
    assert all(row["oop"][3] == "0" and row["ip"][3] == "0" for row in parse_table(output))


def test_an_injected_wrong_result_fails_the_run():
    output = run_mpi("bench", 2, "allreduce", "-b", "64", "-e", "64", "-n", "1", "-w", "0",
                     "--rounds", "1", env={INJECT_WRONG_VARIABLE: "1"}, expected_status=1,
                     timeout=240)
    assert "FAILED" in output
    assert all(row["oop"][3] == "1" for row in parse_table(output))


def test_plot_draws_one_line_per_algorithm(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [report.Row(size, size // 4, "float32", "sum", -1, algorithm,
                       report.result(size, 1e-5 * (i + 1), 1.0, 0, None), None)
            for i, algorithm in enumerate(("ring", "native")) for size in (1024, 4096)]
    path = tmp_path / "busbw.png"
    report.plot(str(path), "allreduce, 2 ranks", rows)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
