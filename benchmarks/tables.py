"""The tables of docs/benchmarks.md, made from the saved ``ringtrain-bench --json`` files.

Every result file is ``benchmarks/results/<collective>-np<N>.json``, written (on an
otherwise idle machine, after ``mkdir -p benchmarks/results``) by::

    mpiexec -n N ringtrain-bench <collective> -b 8 -e 64M -f 4 --algo auto,native \\
        --json benchmarks/results/<collective>-np<N>.json

and gives, in its collective's table, a group of columns: per size, ringtrain's ``auto``
time, the MPI library's own (``native``) time and ``xnative`` (busbw of ``auto`` over
``native``'s, measured in the same rounds) out of place, and ``xnative`` in place where
the collective has that form; under the table, the commands, and the machine, the MPI
library and the ranks the files record. The tables
stand in docs/benchmarks.md between the two marker lines :data:`BEGIN` and :data:`END`.

    python benchmarks/tables.py            # print the tables
    python benchmarks/tables.py --write    # put them into docs/benchmarks.md
    python benchmarks/tables.py --check    # exit 1 if docs/benchmarks.md's differ

Standard library only: it reads JSON and writes markdown, and needs neither MPI nor
ringtrain.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reducescatter", "alltoall")
"""The collectives, in the order of their tables."""

BEGIN = ("<!-- tables: made by `python benchmarks/tables.py --write` from "
         "benchmarks/results; do not edit -->")
END = "<!-- end of tables -->"

NAME = re.compile(r"^(?P<collective>[a-z]+)-np(?P<ranks>[0-9]+)\.json$")

NO_RESULTS = ("No results are saved in `benchmarks/results/` yet: run the commands above "
              "on an otherwise idle machine, then `python benchmarks/tables.py --write`.")


class ResultsError(ValueError):
    """A result file that cannot make a table: the message names the file and why."""


@dataclass(frozen=True)
class Point:
    """``auto`` and ``native`` at one size and mode."""

    auto_us: float
    native_us: float | None
    ratio: float | None


@dataclass(frozen=True)
class Table:
    """One result file: a collective at one number of ranks."""

    collective: str
    ranks: int
    run: dict[str, str]
    sizes: tuple[int, ...]
    out_of_place: tuple[Point, ...]
    in_place: tuple[Point, ...] | None
    name: str


def load(path: Path) -> Table:
    """The table of one result file, checked against its name.

    Raises:
        ResultsError: the name is not ``<collective>-np<N>.json``, the file is not a
            ``ringtrain-bench --json`` file of that collective and number of ranks, or
            it lacks ``auto`` or ``native`` rows.
    """
    match = NAME.match(path.name)
    if not match or match["collective"] not in COLLECTIVES:
        raise ResultsError(f"{path}: not named <collective>-np<N>.json with a collective "
                           f"of {', '.join(COLLECTIVES)}")
    collective, ranks = match["collective"], int(match["ranks"])
    try:
        recorded = json.loads(path.read_text())
        run, rows = recorded["run"], recorded["rows"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ResultsError(f"{path}: not a ringtrain-bench --json file ({error})") from None
    said = str(run.get("ringtrain-bench", ""))
    if said.split(",")[0].strip() != collective:
        raise ResultsError(f"{path}: the file measured {said.split(',')[0] or 'nothing'!r}, "
                           f"its name says {collective}")
    if not str(run.get("ranks", "")).startswith(f"{ranks} on "):
        raise ResultsError(f"{path}: the file ran on {run.get('ranks')!r} ranks, its name "
                           f"says {ranks}")
    by_algorithm: dict[str, dict[int, dict]] = {"auto": {}, "native": {}}
    for row in rows:
        if row.get("algorithm") in by_algorithm and row.get("memory") in (None, "host"):
            by_algorithm[row["algorithm"]][int(row["size"])] = row
    missing = [name for name, found in by_algorithm.items() if not found]
    if missing:
        raise ResultsError(f"{path}: no {' or '.join(missing)} rows (measure with "
                           f"--algo auto,native)")
    sizes = tuple(sorted(by_algorithm["auto"]))
    modes = []
    for mode in ("out_of_place", "in_place"):
        points = []
        for size in sizes:
            mine = by_algorithm["auto"][size].get(mode)
            theirs = (by_algorithm["native"].get(size) or {}).get(mode)
            if mine is None:
                break
            points.append(Point(float(mine["time_us"]),
                                None if theirs is None else float(theirs["time_us"]),
                                mine.get("ratio")))
        modes.append(tuple(points) if len(points) == len(sizes) else None)
    return Table(collective, ranks, {key: str(value) for key, value in run.items()},
                 sizes, modes[0] or (), modes[1], path.name)


def tables(results: Path) -> list[Table]:
    """Every result file under ``results``, in :data:`COLLECTIVES` order, then by ranks."""
    found = [load(path) for path in sorted(results.glob("*.json"))] \
        if results.is_dir() else []
    return sorted(found, key=lambda table: (COLLECTIVES.index(table.collective), table.ranks))


def size_text(nbytes: int) -> str:
    """8 B, 2 KiB, 64 MiB; sizes that are not a whole number of units in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def time_text(microseconds: float | None) -> str:
    """Three significant figures, or at least whole microseconds."""
    if microseconds is None:
        return "n/a"
    if microseconds < 10:
        return f"{microseconds:.2f}"
    if microseconds < 100:
        return f"{microseconds:.1f}"
    return f"{microseconds:.0f}"


def ratio_text(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}"


def size_argument(nbytes: int) -> str:
    """A size as ringtrain-bench's ``-b`` and ``-e`` take it: 8, 2K, 64M."""
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{suffix}"
    return str(nbytes)


def command_of(table: Table) -> str:
    """The command that measured the file, after ``mpiexec -n N``: as the file records
    it, or, for a file without it, the one of this module's docstring."""
    command = table.run.get("command")
    if not command:
        factor = table.sizes[1] // table.sizes[0] if len(table.sizes) > 1 else 4
        command = (f"ringtrain-bench {table.collective} -b {size_argument(table.sizes[0])} "
                   f"-e {size_argument(table.sizes[-1])} -f {factor} --algo auto,native "
                   f"--json benchmarks/results/{table.name}")
    return f"mpiexec -n {table.ranks} {command}"


def described(run: dict[str, str], key: str) -> str:
    """One fact of a file's run for the caption: ``machine: ...``, ``ringtrain 0.1.0``."""
    value = " ".join(run.get(key, "").split())
    if key == "ringtrain-bench":          # "allreduce, ringtrain 0.1.0"
        return value.split(", ", 1)[1] if ", " in value else ""
    return f"{key}: {value}" if value else ""


CAPTION_KEYS = ("machine", "MPI", "ringtrain-bench", "buffers", "ranks")
"""What the caption says of each file, after its command: what all the collective's files
share once, the rest after each command."""


def markdown(collective: str, group: Sequence[Table]) -> list[str]:
    """One collective's table, a group of columns per number of ranks, and the caption
    saying what measured it. Each group: ``auto``'s time, ``native``'s time and
    ``xnative`` out of place, and ``xnative`` in place where the collective has that
    form. A size of 0 bytes (8 B split among 4 ranks) moves nothing and is left out."""
    titles = ["size"]
    for table in group:
        titles += [f"{table.ranks} ranks: `auto` µs", "`native` µs", "xnative"]
        if table.in_place is not None:
            titles.append("xnative in place")
    lines = [f"### {collective}", "", "| " + " | ".join(titles) + " |",
             "|" + "---:|" * len(titles)]
    for size in sorted({size for table in group for size in table.sizes if size > 0}):
        cells = [size_text(size)]
        for table in group:
            width = 3 + (table.in_place is not None)
            if size not in table.sizes:
                cells += [""] * width
                continue
            index = table.sizes.index(size)
            point = table.out_of_place[index]
            cells += [time_text(point.auto_us), time_text(point.native_us),
                      ratio_text(point.ratio)]
            if table.in_place is not None:
                cells.append(ratio_text(table.in_place[index].ratio))
        lines.append("| " + " | ".join(cells) + " |")
    shared = [key for key in CAPTION_KEYS
              if len({described(table.run, key) for table in group}) == 1]
    commands = []
    for table in group:
        own = [fact for fact in (described(table.run, key) for key in CAPTION_KEYS
                                 if key not in shared) if fact]
        commands.append(f"`{command_of(table)}`" + (f" ({'; '.join(own)})" if own else ""))
    facts = [fact for fact in (described(group[0].run, key) for key in shared) if fact]
    lines += ["", "; ".join(commands + facts) + ".", ""]
    return lines


def render(found: Sequence[Table]) -> str:
    """The text between the markers: every table, or a line saying there are none."""
    if not found:
        return NO_RESULTS + "\n"
    lines: list[str] = []
    for collective in COLLECTIVES:
        group = [table for table in found if table.collective == collective]
        if group:
            lines += markdown(collective, group)
    return "\n".join(lines).rstrip("\n") + "\n"


def replaced(document: str, block: str, where: str = "the document") -> str:
    """``document`` with the text between :data:`BEGIN` and :data:`END` made ``block``."""
    start, end = document.find(BEGIN), document.find(END)
    if start < 0 or end < start:
        raise ResultsError(f"{where} has no '{BEGIN}' line followed by an '{END}' line")
    head = document[:start + len(BEGIN)]
    return head + "\n\n" + block + "\n" + document[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true",
                        help="put the tables into the document, between the markers")
    action.add_argument("--check", action="store_true",
                        help="exit 1 if the document's tables differ from the results")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of <collective>-np<N>.json files (default "
                             "benchmarks/results)")
    parser.add_argument("--doc", type=Path, default=DOC,
                        help="the document (default docs/benchmarks.md)")
    arguments = parser.parse_args(argv)
    try:
        block = render(tables(arguments.results))
        if not (arguments.write or arguments.check):
            sys.stdout.write(block)
            return 0
        document = arguments.doc.read_text()
        expected = replaced(document, block, str(arguments.doc))
    except (ResultsError, OSError) as error:
        print(f"tables.py: error: {error}", file=sys.stderr)
        return 2
    if arguments.write:
        if expected != document:
            arguments.doc.write_text(expected)
        return 0
    if expected == document:
        return 0
    diff = difflib.unified_diff(document.splitlines(), expected.splitlines(),
                                str(arguments.doc), "from the results", lineterm="")
    print("\n".join(diff), file=sys.stderr)
    print(f"tables.py: {arguments.doc}'s tables differ from {arguments.results}: run "
          f"python benchmarks/tables.py --write", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
