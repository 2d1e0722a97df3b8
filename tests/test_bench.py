"""ringtrain-bench: size parsing, bandwidth formulas, output format, and real runs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mpi_launch import gpu_found, require_gpu, run_mpi
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


def test_device_options_and_what_each_size_measures():
    cpu = parse_options(["allreduce", "--algo", "ring,native"])
    assert cpu.device == "cpu" and cpu.device_library == "auto"
    assert cases.variants(cpu) == [("ring", "host"), ("native", "host")]
    cuda = parse_options(["allreduce", "--algo", "auto,ring,native", "--device", "cuda",
                          "--device-library", "numba", "--compression", "fp16"])
    assert cuda.device == "cuda" and cuda.device_library == "numba"
    assert cases.variants(cuda) == [("auto", "cuda"), ("auto", "host"), ("ring", "cuda"),
                                    ("ring", "host"), ("native", "host")]
    ipc = parse_options(["allreduce", "--algo", "ipc,ring", "--device", "cuda"])
    assert cases.variants(ipc) == [("ipc", "cuda"), ("ring", "cuda"), ("ring", "host")]


@pytest.mark.processes
def test_parsing_device_options_imports_no_gpu_library():
    """The bench adds no GPU library to what importing the collectives imports."""
    probe = ("import sys\n"
             "def gpu():\n"
             "    return {m for m in sys.modules if m.split('.')[0] in ('cupy', 'torch')\n"
             "            or m.startswith('numba.cuda')}\n"
             "import ringtrain.collectives\n"
             "before = gpu()\n"
             "from ringtrain.collectives.bench import cli\n"
             "from ringtrain.collectives.bench.options import parse_options\n"
             "parse_options(['allreduce', '--device', 'cuda', '--device-library', 'cupy'])\n"
             "print(sorted(gpu() - before))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("argv, message", [
    (["allreduce", "-b", "0"], "minbytes"),
    (["allreduce", "-b", "12X"], "not a size"),
    (["allreduce", "--algo", "pipeline"], "offers the algorithms"),
    (["allgather", "--algo", "binomial"], "offers the algorithms"),
    (["allreduce", "-o", "avg", "-d", "int32"], "avg needs a floating"),
    (["broadcast", "--compression", "fp16"], "--compression applies"),
    (["allreduce", "--compression", "bf16", "-o", "prod"], "not prod"),
    (["allreduce", "--device", "cuda", "--algo", "native"], "names only native"),
    (["allreduce", "--algo", "ipc,native"], "add --device cuda"),
    (["broadcast", "--device", "cuda", "--algo", "ipc"], "offers the algorithms"),
    (["allreduce", "--device-library", "cupy"], "applies to --device cuda"),
    (["allreduce", "--device", "cuda", "--device-library", "jax"], "invalid choice"),
    (["allreduce", "-n", "0"], "--iters"),
    (["gather"], "invalid choice"),
    (["reducescatter", "-o", "adasum"], "-o adasum measures allreduce"),
    (["allreduce", "-o", "adasum", "-d", "int32"], "-o adasum measures allreduce"),
    (["allreduce", "-o", "adasum", "--compression", "fp16"], "-o adasum measures allreduce"),
    (["allreduce", "-o", "adasum", "--algo", "ring,native"], "runs its own algorithm"),
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


def test_adasum_check_inputs_are_orthogonal_so_their_adasum_is_their_sum():
    """Rank r fills only the elements i with i % ranks == r: every partial result of the
    tree stays orthogonal to the others, so Adasum equals MPI's sum (the baseline)."""
    assert parse_options(["allreduce", "-o", "adasum"]).algorithms == ("auto", "native")
    for ranks in (1, 2, 3, 4):
        inputs = np.array([cases.check_input(r, 1001, np.float32, "adasum", ranks)
                           for r in range(ranks)])
        assert np.all(np.count_nonzero(inputs, axis=0) == 1)
        assert np.all(inputs.sum(axis=0) >= 1)


# --------------------------------------------------------------------------- output

def parse_table(output: str) -> list[dict]:
    """The data lines of the table, as dicts of the out-of-place and in-place columns
    (and, for ``--device cuda``, of the ``memory`` column; None for a CPU run)."""
    titles = next((line for line in output.splitlines()
                   if line.startswith("#") and "time(us)" in line), "")
    memory = " memory " in titles
    prefix = 7 if memory else 6
    rows = []
    for line in output.splitlines():
        if line.startswith("#") or not line.strip() or not line.strip()[0].isdigit():
            continue
        fields = line.split()
        expected = (17, 19) if memory else (14, 16)
        assert len(fields) in expected, f"unexpected columns: {line!r}"
        width = (len(fields) - prefix) // 2
        rows.append({
            "size": int(fields[0]), "count": int(fields[1]), "type": fields[2],
            "redop": fields[3], "root": int(fields[4]),
            "memory": fields[5] if memory else None, "algo": fields[prefix - 1],
            "oop": fields[prefix:prefix + width], "ip": fields[prefix + width:],
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


def test_device_rows_add_the_memory_and_xhost_columns(tmp_path):
    device = report.result(4096, 1e-5, 1.0, 0, 2.0)
    device.host_ratio = 0.5
    rows = [report.Row(4096, 1024, "float32", "sum", -1, "ring", device, None, "cuda"),
            report.Row(4096, 1024, "float32", "sum", -1, "ring",
                       report.result(4096, 5e-6, 1.0, 0, 2.0), None, "host")]
    rows[1].out_of_place.host_ratio = 1.0
    header = report.header_lines({"MPI": "test"}, with_ratio=True, with_memory=True)
    titles = header[-1]
    line = report.format_row(rows[0], with_ratio=True)
    assert len(line) == len(titles) and "xhost" in titles
    assert titles.index("memory") + len("memory") == line.index("cuda") + len("cuda")
    assert line.split()[11:13] == ["0.20", "0.50"] and line.split()[-1] == "n/a"
    assert "(ring, cuda)" in report.footer_lines(rows)[1]
    assert "(ring, host)" in report.footer_lines(rows)[2]
    record = report.flat_record(rows[0])
    assert record["memory"] == "cuda" and record["oop_host_ratio"] == 0.5
    assert "ip_host_ratio" in record and record["ip_host_ratio"] is None
    path = tmp_path / "rows.json"
    report.write_json(str(path), {"MPI": "test"}, rows)
    assert json.loads(path.read_text())["rows"][1]["memory"] == "host"


def test_cpu_rows_keep_their_columns_and_fields():
    row = report.Row(4096, 1024, "float32", "sum", -1, "ring",
                     report.result(4096, 1e-5, 1.0, 0, None), None)
    assert "memory" not in report.header_lines({}, with_ratio=False)[-1]
    assert len(report.format_row(row, with_ratio=False).split()) == 14
    assert list(report.flat_record(row)) == [
        "size", "count", "type", "redop", "root", "algorithm",
        "oop_time_us", "oop_algbw", "oop_busbw", "oop_wrong", "oop_ratio",
        "ip_time_us", "ip_algbw", "ip_busbw", "ip_wrong", "ip_ratio"]


def test_the_run_records_its_machine_and_command():
    machine = report.machine_description()
    assert "CPUs" in machine and "Python" in machine
    assert report.command_line(["allreduce", "--algo", "auto,native", "--json", "a b.json"]) \
        == "ringtrain-bench allreduce --algo auto,native --json 'a b.json'"


# --------------------------------------------------------------------------- real runs

@pytest.mark.processes
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
    assert "CPUs" in recorded["run"]["machine"]
    assert recorded["run"]["command"].startswith(f"ringtrain-bench {collective} -b 8 ")
    assert len(csv_path.read_text().splitlines()) == len(rows) + 1


@pytest.mark.processes
def test_compressed_reducescatter_checks_out():
    output = run_mpi("bench", 2, "reducescatter", "-b", "1K", "-e", "64K", "-f", "8",
                     "-n", "2", "-w", "1", "--rounds", "1", "--compression", "bf16",
                     "--algo", "ring,hierarchical,native", timeout=240)
    assert "bf16 compression" in output
    rows = parse_table(output)
    assert {row["algo"] for row in rows} == {"ring", "hierarchical", "native"}
    assert all(row["oop"][3] == "0" for row in rows)


@pytest.mark.processes
def test_compressed_allreduce_and_floating_average_check_out():
    output = run_mpi("bench", 2, "allreduce", "-b", "1K", "-e", "64K", "-f", "8",
                     "-n", "2", "-w", "1", "--rounds", "1", "-o", "avg",
                     "--compression", "fp16", "--algo", "ring,native", timeout=240)
    assert "fp16 compression" in output
    assert all(row["oop"][3] == "0" and row["ip"][3] == "0" for row in parse_table(output))


@pytest.mark.processes
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


# --------------------------------------------------------------------------- GPU buffers

NO_DEVICE_LINE = "ringtrain-bench: error: --device cuda: no CUDA device found"


def check_device_table(output: str, algorithms: list[str], sizes: list[int],
                       in_place: bool) -> list[dict]:
    """Every variant at every size, in order, checked; xhost 1.00 on host rows."""
    rows = parse_table(output)
    expected = [(algorithm, memory) for algorithm in algorithms
                for memory in (("host",) if algorithm == "native" else ("cuda", "host"))]
    assert [(row["algo"], row["memory"]) for row in rows] == expected * len(sizes), output
    assert sorted({row["size"] for row in rows}) == sizes, output
    for row in rows:
        modes = (row["oop"], row["ip"]) if in_place else (row["oop"],)
        for mode in modes:
            assert mode[3] == "0", row
            if row["memory"] == "host" and row["count"]:
                assert mode[-1] == "1.00", row
        if not in_place:
            assert row["ip"] == ["n/a"] * len(row["ip"]), row
    assert "# Out of bounds values : 0 OK" in output
    assert "xhost" in output and " memory " in output
    return rows


@pytest.mark.processes
def test_device_cuda_on_the_simulator_measures_gpu_and_host_buffers(tmp_path):
    csv_path = tmp_path / "out.csv"
    output = run_mpi("bench", 2, "allreduce", "--device", "cuda", "-b", "8", "-e", "256",
                     "-f", "4", "-n", "1", "-w", "0", "--rounds", "1",
                     "--algo", "ring,native", "--csv", str(csv_path),
                     env={"NUMBA_ENABLE_CUDASIM": "1"}, timeout=300)
    assert "numba's CUDA simulator" in output and "# CUDA-aware MPI:" in output
    rows = check_device_table(output, ["ring", "native"], [8, 32, 128], in_place=True)
    assert all(len(row["oop"]) == 6 for row in rows)  # ... #wrong xnative xhost
    assert "# Avg bus bandwidth    : " in output and "(ring, cuda)" in output
    lines = csv_path.read_text().splitlines()
    assert len(lines) == len(rows) + 1 and "memory" in lines[0] and "oop_host_ratio" in lines[0]


@pytest.mark.processes
def test_device_cuda_compressed_and_partitioned_collectives_on_the_simulator():
    output = run_mpi("bench", 2, "allreduce", "--device", "cuda", "-b", "256", "-e", "256",
                     "-n", "1", "-w", "1", "--rounds", "1", "-o", "avg",
                     "--compression", "fp16", "--algo", "auto",
                     env={"NUMBA_ENABLE_CUDASIM": "1"}, timeout=300)
    assert "fp16 compression" in output
    rows = check_device_table(output, ["auto"], [256], in_place=True)
    assert all(len(row["oop"]) == 5 for row in rows)  # no native: no xnative column
    for collective in ("broadcast", "allgather", "reducescatter", "alltoall"):
        output = run_mpi("bench", 2, collective, "--device", "cuda", "-b", "64", "-e", "64",
                         "-n", "1", "-w", "0", "--rounds", "1", "-d", "int32", "-r", "1",
                         "--algo", "auto,native", env={"NUMBA_ENABLE_CUDASIM": "1"},
                         timeout=300)
        check_device_table(output, ["auto", "native"], [64],
                           in_place=collective == "broadcast")


@pytest.mark.processes
def test_device_cuda_without_a_gpu_exits_2_with_one_line():
    if gpu_found():
        pytest.skip("a CUDA GPU is present")
    output = run_mpi("bench", 2, "allreduce", "--device", "cuda", "-b", "8", "-e", "8",
                     env={"NUMBA_ENABLE_CUDASIM": "0"}, expected_status=2, timeout=120)
    errors = [line for line in output.splitlines() if line.startswith("ringtrain-bench:")]
    assert len(errors) == 1 and errors[0].startswith(NO_DEVICE_LINE), output
    assert "numba sees no GPU" in errors[0] and "size(B)" not in output


@pytest.mark.processes
def test_device_cuda_on_a_gpu():
    """Skips without a GPU, unless RINGTRAIN_TEST_GPU=1 makes that a failure."""
    require_gpu()
    output = run_mpi("bench", 2, "allreduce", "--device", "cuda", "-b", "8", "-e", "1M",
                     "-f", "16", "-n", "5", "-w", "2", "--rounds", "1",
                     "--algo", "ring,native", env={"NUMBA_ENABLE_CUDASIM": "0"}, timeout=300)
    check_device_table(output, ["ring", "native"], [8, 128, 2048, 32768, 524288],
                       in_place=True)
    assert "simulator" not in output
