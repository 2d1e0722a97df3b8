"""Byte-stream filters: prefix every line with the rank; take report records out."""

from __future__ import annotations

import errno
import os
import re

from .report import RECORD_TAG, RankExit, decode

_LINE_PIECES = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``; drop it when the reader has gone (EPIPE)."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError as error:
            if error.errno in (errno.EPIPE, errno.EBADF):
                return
            raise
        view = view[written:]


class LinePrefixer:
    """Puts ``prefix`` before every line of a stream (``\\n``, ``\\r`` or ``\\r\\n`` end one).

    Whole lines are passed on together, each in one piece, so that lines of ranks
    writing at the same time do not mix even when a line was written in several parts
    (Python's unbuffered ``print`` writes each argument separately). The start of a line
    not yet ended is held until :meth:`flush`, which the caller calls when the stream has
    been quiet for a moment, so prompts and progress bars still show.
    """

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self._held = bytearray()
        self._line_shown = False  # part of the current line was passed on by flush()
        self._after_carriage_return = False

    @property
    def at_line_start(self) -> bool:
        """Whether everything passed on so far ends with a line end."""
        return not self._held and not self._line_shown

    def feed(self, data: bytes) -> bytes:
        """The whole lines, prefixed, that the next chunk of the stream completes."""
        out = bytearray()
        for piece in _LINE_PIECES.findall(data):
            if not piece.endswith((b"\n", b"\r")):
                self._held += piece
                continue
            # A "\r\n" split between two chunks ends one line, not two.
            if not (piece == b"\n" and self._after_carriage_return and self.at_line_start):
                if not self._line_shown:
                    out += self.prefix
                out += self._held + piece
            else:
                out += piece
            self._held.clear()
            self._line_shown = False
            self._after_carriage_return = piece.endswith(b"\r")
        return bytes(out)

    def flush(self) -> bytes:
        """The held start of an unfinished line, prefixed if it is the line's first part."""
        if not self._held:
            return b""
        out = (b"" if self._line_shown else self.prefix) + self._held
        self._held.clear()
        self._line_shown = True
        self._after_carriage_return = False
        return out


class RecordFilter:
    """Splits a stream into the text to show and the :class:`RankExit` records in it.

    A record is a whole line starting with :data:`~ringtrain.launcher.report.RECORD_TAG`.
    Text that might still become one (a line start matching the tag so far) waits for
    the next chunk; everything else passes at once.
    """

    def __init__(self) -> None:
        self.pending = b""
        self.at_line_start = True

    def feed(self, data: bytes) -> tuple[bytes, list[RankExit]]:
        """Text to show and records found in the next chunk of the stream."""
        buffer = self.pending + data
        self.pending = b""
        shown = bytearray()
        records: list[RankExit] = []
        while buffer:
            if self.at_line_start:
                if buffer.startswith(RECORD_TAG):
                    end = buffer.find(b"\n")
                    if end < 0:
                        self.pending = buffer
                        break
                    record = decode(buffer[:end + 1])
                    if record is not None:
                        records.append(record)
                    else:
                        shown += buffer[:end + 1]
                    buffer = buffer[end + 1:]
                    continue
                if RECORD_TAG.startswith(buffer):
                    self.pending = buffer
                    break
            end = buffer.find(b"\n")
            if end < 0:
                shown += buffer
                self.at_line_start = False
                break
            shown += buffer[:end + 1]
            buffer = buffer[end + 1:]
            self.at_line_start = True
        return bytes(shown), records

    def finish(self) -> bytes:
        """Whatever was held back, at the end of the stream."""
        pending, self.pending = self.pending, b""
        return pending
