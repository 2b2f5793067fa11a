"""Crash-safe files: atomic replacement, safe appends, and text read line by line.

Every file ``mt`` writes goes through here, so a process killed at any instant leaves each file
as it was or complete: :func:`atomic_path` (and :func:`write_text`, :func:`write_json`,
:func:`atomic_text_output`) writes a temporary ``.<name>.tmp<pid>`` beside the target, fsyncs it
and renames it over the target (:func:`remove_stale_temps` removes those of killed writes);
:class:`JsonlAppender` appends JSON records and cuts a torn last line on reopening;
:func:`read_lines` splits text on ``"\\n"`` only and decodes it line by line, so an error names
the line.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

TEMP = re.compile(r"^\..+\.tmp\d+$")  # the temporaries written here: .<name>.tmp<pid>
FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


class TextError(ValueError):
    """A text file that cannot be read as UTF-8 lines (the message names file and line)."""


def temp_path(path: Path) -> Path:
    """The temporary a write of ``path`` goes through in this process."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def disk_full(err: BaseException) -> bool:
    """True when ``err`` or an exception it was raised from is ENOSPC, EFBIG or EDQUOT (torch
    wraps the OSError of a failed write in a RuntimeError)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def _atomic_file(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary temporary file whose content replaces ``path`` (its directory created) when the
    block ends without an exception; on a failure ``path`` is untouched and a full disk raises
    ``OSError(ENOSPC)`` saying so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, Exception) and disk_full(err):
            raise OSError(
                errno.ENOSPC,
                f"disk full (no space left, quota or file-size limit) while writing {path}; "
                "nothing was replaced: the previous files are intact",
            ) from err
        raise
    fsync_dir(path.parent)


def atomic_path(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` atomically: ``write(f)`` fills the temporary file (:func:`_atomic_file`)."""
    with _atomic_file(path) as f:
        write(f)


@contextlib.contextmanager
def atomic_text_output(path: str | Path) -> Iterator[IO[str]]:
    """A text stream (UTF-8, ``"\\n"`` line ends) whose content replaces ``path`` atomically when
    the block ends without an exception."""
    with _atomic_file(path) as f:
        text = io.TextIOWrapper(f, encoding="utf-8", newline="\n")
        try:
            yield text
            text.flush()
        finally:  # the file is _atomic_file's to close
            with contextlib.suppress(OSError, ValueError):
                text.detach()


def write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    atomic_path(path, lambda f: f.write(data))


def write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with UTF-8 ``text`` atomically (newlines written as given)."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, data: Any, indent: int | None = 2) -> None:
    """Replace ``path`` with ``data`` as JSON (UTF-8, a final newline) atomically."""
    write_text(path, json.dumps(data, indent=indent, ensure_ascii=False, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when it is missing, not an object or not UTF-8 JSON
    (the last logged)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        log.warning("%s: not JSON, skipped", path)
        return {}
    return data if isinstance(data, dict) else {}


def write_lines(path: str | Path, lines: Iterable[str]) -> int:
    """Replace ``path`` with one line per item atomically (a line break inside an item becomes
    a space, so line i is always item i); returns the number of lines."""
    count = 0
    with _atomic_file(path) as f:
        for line in lines:
            f.write((one_line(line) + "\n").encode("utf-8"))
            count += 1
    return count


def one_line(text: str) -> str:
    """``text`` with every ``\\r\\n``, ``\\n`` and ``\\r`` replaced by one space."""
    if "\n" in text or "\r" in text:
        return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    return text


def remove_stale_temps(*directories: Path) -> list[Path]:
    """Delete the ``.<name>.tmp<pid>`` files of killed writes in ``directories`` (not
    recursive); returns what was removed. Call only while holding the run directory's lock."""
    removed = []
    for directory in directories:
        if not directory.is_dir():
            continue
        for p in sorted(directory.iterdir()):
            if TEMP.match(p.name) and p.is_file():
                size = p.stat().st_size
                p.unlink(missing_ok=True)
                log.warning("removed %s (%.1f MB) left by a killed save", p, size / 2**20)
                removed.append(p)
    return removed


class JsonlAppender:
    """An append-only JSON-lines file, safe against kills and resumes.

    Opening it cuts, with one ``truncate``, a torn last line (no ``"\\n"`` or not JSON) and,
    with ``keep_through_step``, every record from the first one whose ``step`` is larger (a
    resumed run writes those steps again). Earlier bytes are never rewritten.
    """

    def __init__(self, path: str | Path, keep_through_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut = self._cut_point(keep_through_step) if self.path.exists() else None
        if cut is not None:
            with open(self.path, "r+b") as f:
                f.truncate(cut)
                f.flush()
                os.fsync(f.fileno())
        self.file = open(self.path, "ab")  # noqa: SIM115 (closed in close())

    def _cut_point(self, keep_through_step: int | None) -> int | None:
        """The byte offset to truncate at, or None to keep everything."""
        offset = 0
        with open(self.path, "rb") as f:
            for raw in f:
                try:
                    record = json.loads(raw) if raw.endswith(b"\n") else None
                except ValueError:
                    record = None
                if not isinstance(record, dict):
                    if raw.strip() or not raw.endswith(b"\n"):
                        log.warning("%s: cutting a torn record at byte %d", self.path, offset)
                        return offset
                elif keep_through_step is not None and _step(record) > keep_through_step:
                    return offset
                offset += len(raw)
        return None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as one line and flush it to the OS."""
        self.file.write((json.dumps(record, default=str) + "\n").encode("utf-8"))
        self.file.flush()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


def _step(record: dict[str, Any]) -> float:
    step = record.get("step")
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else -1


def read_lines(stream: Iterable[bytes], name: str, first_line: int = 1) -> Iterator[str]:
    """Decode a binary stream into lines without their ending (split on ``b"\\n"`` alone; a
    ``"\\r\\n"`` ending is one line end), each checked: a :class:`TextError` names the file
    (``name``) and line of one that is not UTF-8 or holds a NUL byte."""
    for lineno, raw in enumerate(stream, first_line):
        yield decode_line(strip_line_end(raw), name, lineno)


def strip_line_end(raw: bytes) -> bytes:
    """A line's bytes without its ``"\\n"`` or ``"\\r\\n"`` ending (a lone ``"\\r"`` stays)."""
    if raw.endswith(b"\n"):
        return raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    return raw


def decode_line(raw: bytes, name: str, lineno: int) -> str:
    """One line's bytes as text (a :class:`TextError` for a NUL byte or invalid UTF-8)."""
    if b"\x00" in raw:
        raise TextError(
            f"{name}, line {lineno}: holds a NUL byte (column {raw.index(0) + 1}); "
            "a binary file? (text must be UTF-8 without NUL bytes)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TextError(
            f"{name}, line {lineno}: not valid UTF-8 ({err.reason} at byte {err.start})"
        ) from None


def file_crc(path: Path) -> int:
    """CRC-32 of a file's bytes, read in 16 MB blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def damaged_file(directory: Path, record: dict | None, full: bool = True) -> Path | None:
    """The first file of ``directory`` whose size or CRC-32 differs from ``record``
    (``{name: [size, crc]}`` or ``[size, crc, mtime_ns]``, as written with the files), or None.

    ``full=False`` reads a file only when its modification time differs from the recorded one
    or none was recorded, so a check at every start costs a ``stat`` a file, not a read of
    gigabytes; damage that keeps size and time (a failing disk) needs ``full=True``.
    """
    for name, (size, crc, *mtime) in (record or {}).items():
        path = directory / name
        try:
            st = path.stat()
            if st.st_size == size and (
                (not full and mtime and st.st_mtime_ns == mtime[0]) or file_crc(path) == crc
            ):
                continue
        except OSError:
            pass
        return path
    return None
