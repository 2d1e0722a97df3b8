"""Run a Python program as ``python`` would, with ringtrain's exception hook installed.

``python -m ringtrain.launcher.run_python train.py ARGS`` runs ``train.py`` like
``python train.py ARGS`` (same ``sys.argv``, same ``sys.path[0]``, ``__name__ ==
"__main__"``); ``-c CODE`` and ``-m MODULE`` work as they do for ``python``. The launcher
rewrites a rank's Python command into this form; see :mod:`ringtrain.common.excepthook`
for what an unhandled exception then does. A non-zero ``sys.exit`` while MPI is running
ends the job the same way, since a normal exit would wait in ``MPI_Finalize`` for ranks
that are blocked in a collective.
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import types
from collections.abc import Sequence

from ..common import excepthook

USAGE = "usage: python -m ringtrain.launcher.run_python (-c CODE | -m MODULE | SCRIPT) [ARGS...]"


def _set_path_entry(entry: str) -> None:
    """Put on ``sys.path[0]`` what ``python`` would, unless Python runs with safe paths."""
    if getattr(sys.flags, "safe_path", False) or getattr(sys.flags, "isolated", False):
        return
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.append(entry)


def _run_code(code: str) -> None:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    exec(compile(code, "<string>", "exec"), main.__dict__)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run(arguments: Sequence[str]) -> None:
    """Run ``-c CODE ARGS``, ``-m MODULE ARGS`` or ``SCRIPT ARGS`` in this process.

    Raises:
        SystemExit: with status 2 and a usage line when no program is given.
    """
    arguments = list(arguments)
    if not arguments or (arguments[0] in ("-c", "-m") and len(arguments) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    excepthook.install(hidden_files={__file__})
    try:
        if arguments[0] == "-c":
            sys.argv = ["-c", *arguments[2:]]
            _set_path_entry("")
            _run_code(arguments[1])
        elif arguments[0] == "-m":
            sys.argv = [arguments[1], *arguments[2:]]
            _set_path_entry(os.getcwd())
            runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
        else:
            # Like python: __file__ and tracebacks show the absolute path.
            sys.argv = arguments
            _set_path_entry(os.path.dirname(os.path.realpath(arguments[0])))
            runpy.run_path(os.path.abspath(arguments[0]), run_name="__main__")
    except SystemExit as exit_request:
        code = _exit_code(exit_request.code)
        if code != 0:
            excepthook.stop_job(code)
        raise SystemExit(code) from None


if __name__ == "__main__":
    run(sys.argv[1:])
