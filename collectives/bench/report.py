"""Output of ``ringtrain-bench``: the nccl-tests table, CSV, JSON and a plot.

A ``--device cuda`` run adds a ``memory`` column (``cuda`` for GPU buffers, ``host`` for
numpy buffers) and, per mode, an ``xhost`` ratio column: busbw on GPU buffers divided by
the same algorithm's on host buffers. A CPU run's table, CSV and JSON have neither.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from .options import NATIVE

HOST_RATIO = "xhost"
"""Title of the ratio column of a ``--device cuda`` run: GPU buffers over host buffers."""

_DEVICE_ONLY = ("memory", "host_ratio")
"""Fields that only a ``--device cuda`` run fills (and writes)."""


@dataclass
class Result:
    """One mode (out-of-place or in-place) of one row.

    Attributes:
        ratio: busbw over ``native``'s at the same size and mode, or None.
        host_ratio: (``--device cuda``) busbw over the same algorithm's on host buffers
            at the same size and mode (1 for host rows), or None.
    """

    time_us: float
    algbw: float
    busbw: float
    wrong: int | None
    ratio: float | None
    host_ratio: float | None = None


@dataclass
class Row:
    """One size and algorithm (and, for ``--device cuda``, where its buffers are:
    ``memory`` is ``cuda`` or ``host``; None in a CPU run)."""

    size: int
    count: int
    type: str
    redop: str
    root: int
    algorithm: str
    out_of_place: Result
    in_place: Result | None
    memory: str | None = None


def result(nbytes: int, seconds: float, factor: float, wrong: int | None,
           baseline_busbw: float | None) -> Result:
    """algbw = bytes / time, busbw = algbw * factor (GB = 1e9 bytes); ratio of busbw to
    the baseline's, when there is one."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    busbw = algbw * factor
    ratio = busbw / baseline_busbw if baseline_busbw else None
    return Result(seconds * 1e6, algbw, busbw, wrong, ratio)


def machine_description() -> str:
    """What the header and the JSON file say of the machine: the processor (Linux's
    ``/proc/cpuinfo`` model name where there is one), its logical CPUs, its memory, the
    operating system and Python, e.g. ``AMD EPYC, 2 CPUs, 23 GiB memory, Linux 6.1.0,
    Python 3.11.9``."""
    processor = ""
    try:
        with open("/proc/cpuinfo") as stream:
            for line in stream:
                if line.startswith("model name"):
                    processor = " ".join(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    parts = [processor or platform.processor() or platform.machine() or "unknown processor",
             f"{os.cpu_count() or '?'} CPUs"]
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        parts.append(f"{memory / (1 << 30):.0f} GiB memory")
    except (AttributeError, OSError, ValueError):
        pass
    parts += [f"{platform.system()} {platform.release()}".strip(),
              f"Python {platform.python_version()}"]
    return ", ".join(part for part in parts if part)


def command_line(argv: Sequence[str]) -> str:
    """The command as the JSON file records it: ``ringtrain-bench`` and its arguments
    (the launcher and the number of ranks are recorded apart)."""
    return shlex.join(["ringtrain-bench", *argv])


def header_lines(description: dict[str, str], with_ratio: bool,
                 with_memory: bool = False) -> list[str]:
    """The comment lines describing the run, and the two column-title lines
    (``with_memory``: the ``memory`` and ``xhost`` columns of a ``--device cuda`` run)."""
    titles = f" {'time(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>7}"
    if with_ratio:
        titles += f" {'x' + NATIVE:>8}"
    if with_memory:
        titles += f" {HOST_RATIO:>6}"
    prefix = (f"# {'size(B)':>10} {'count':>10} {'type':>7} {'redop':>6} {'root':>5} "
              + (f"{'memory':>6} " if with_memory else "") + f"{'algo':>18}")
    lines = [f"# {key}: {value}" for key, value in description.items()]
    lines.append("#" + " " * (len(prefix) - 1)
                 + f"{'out-of-place':>{len(titles)}} {'in-place':>{len(titles)}}")
    lines.append(prefix + titles + " " + titles)
    return lines


def _ratio(value: float | None, width: int) -> str:
    return f" {value:>{width}.2f}" if value is not None else f" {'-':>{width}}"


def _mode(part: Result | None, with_ratio: bool, with_memory: bool) -> str:
    if part is None:
        text = f" {'n/a':>9} {'n/a':>7} {'n/a':>7} {'n/a':>7}"
        return text + (f" {'n/a':>8}" if with_ratio else "") + \
            (f" {'n/a':>6}" if with_memory else "")
    wrong = "-" if part.wrong is None else str(part.wrong)
    text = f" {part.time_us:>9.2f} {part.algbw:>7.3f} {part.busbw:>7.3f} {wrong:>7}"
    if with_ratio:
        text += _ratio(part.ratio, 8)
    if with_memory:
        text += _ratio(part.host_ratio, 6)
    return text


def format_row(row: Row, with_ratio: bool) -> str:
    """One table line, nccl-tests' columns plus the algorithm (and ratio) columns; a row
    with ``memory`` set also has the ``memory`` and ``xhost`` columns."""
    with_memory = row.memory is not None
    memory = f"{row.memory:>6} " if with_memory else ""
    return (f"  {row.size:>10} {row.count:>10} {row.type:>7} {row.redop:>6} {row.root:>5} "
            f"{memory}{row.algorithm:>18}{_mode(row.out_of_place, with_ratio, with_memory)} "
            f"{_mode(row.in_place, with_ratio, with_memory)}")


def label(row: Row) -> str:
    """The row's algorithm, and where its buffers are in a ``--device cuda`` run."""
    return row.algorithm if row.memory is None else f"{row.algorithm}, {row.memory}"


def footer_lines(rows: list[Row]) -> list[str]:
    """Wrong values in total, each algorithm's average bus bandwidth (per kind of
    buffer in a ``--device cuda`` run) and its lowest ratio to ``native``."""
    wrong = sum(part.wrong or 0 for row in rows
                for part in (row.out_of_place, row.in_place) if part is not None)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    for name in dict.fromkeys(label(row) for row in rows):
        values = [part.busbw for row in rows if label(row) == name
                  for part in (row.out_of_place, row.in_place) if part is not None]
        average = f"{sum(values) / len(values):.4f} GB/s" if values else "n/a"
        lines.append(f"# Avg bus bandwidth    : {average} ({name})")
    for name in dict.fromkeys(label(row) for row in rows):
        ratios = [(part.ratio, row.size, mode) for row in rows if label(row) == name
                  for part, mode in ((row.out_of_place, "out of place"),
                                     (row.in_place, "in place"))
                  if part is not None and part.ratio is not None]
        if ratios and name != "native":
            ratio, size, mode = min(ratios)
            lines.append(f"# Lowest xnative       : {ratio:.2f} at {size} B, {mode} ({name})")
    return lines


def _record(row: Row) -> dict:
    """``asdict(row)``, less the ``--device cuda`` fields in a CPU run."""
    record = asdict(row)
    if row.memory is None:
        del record["memory"]
        for part in (record["out_of_place"], record["in_place"]):
            if part is not None:
                del part["host_ratio"]
    return record


def flat_record(row: Row) -> dict:
    """One row as a flat dict (CSV columns)."""
    whole = _record(row)
    record = {key: value for key, value in whole.items()
              if key not in ("out_of_place", "in_place")}
    names = [field.name for field in fields(Result)
             if row.memory is not None or field.name not in _DEVICE_ONLY]
    for mode, part in (("oop", whole["out_of_place"]), ("ip", whole["in_place"])):
        for key, value in (part or dict.fromkeys(names)).items():
            record[f"{mode}_{key}"] = value
    return record


def write_csv(path: str, rows: list[Row]) -> None:
    """All rows as CSV, one line per size and algorithm."""
    records = [flat_record(row) for row in rows]
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(records[0]) if records else ["size"])
        writer.writeheader()
        writer.writerows(records)


def write_json(path: str, description: dict[str, str], rows: list[Row]) -> None:
    """The run's description and all rows as JSON."""
    with open(path, "w") as stream:
        json.dump({"run": description, "rows": [_record(row) for row in rows]}, stream,
                  indent=1)


def plot(path: str, title: str, rows: list[Row]) -> None:
    """busbw against size, one line per algorithm (and kind of buffer), out-of-place,
    log-log."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(label(row) for row in rows):
        mine = [row for row in rows if label(row) == name and row.out_of_place is not None]
        axes.plot([row.size for row in mine], [row.out_of_place.busbw for row in mine],
                  marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
