"""Reading and writing the project's files: typed errors on read, atomic writes.

Every reader of a user's file goes through :func:`read_text` / :func:`read_json`, so a missing
file, a directory, a file that is not UTF-8, an empty file, malformed or too deeply nested JSON,
or a number with thousands of digits is a :class:`~torchplace.errors.WorkloadFormatError` that
names the file, never an ``OSError``, ``UnicodeDecodeError`` or ``RecursionError`` traceback.

Every JSON file the project writes (plans, clusters, graphs) goes through :func:`write_json`,
which writes a temporary file in the target's directory and renames it over the target
(``os.replace``, atomic on POSIX and Windows): an interrupted run leaves either the old file or
the new one, never half of one.

Torch-free.
"""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchplace.errors import UsageError, WorkloadFormatError

__all__ = ["json_kind", "parse_json", "read_json", "read_text", "write_json", "write_text"]


def read_text(path: str | Path, what: str = "input") -> str:
    """The text of a UTF-8 file (a leading byte-order mark is dropped).

    Args:
        path: the file.
        what: what the file is, for the message (``"workload"``, ``"plan"``).

    Raises:
        WorkloadFormatError: naming the file when it cannot be read (missing, a directory, no
            permission) or is not UTF-8 (naming the line and offset of the first bad byte).
    """
    path = Path(path)
    try:
        if path.is_dir():
            raise WorkloadFormatError(f"cannot read {what} file {path}: it is a directory; give a file")
        data = path.read_bytes()
    except OSError as e:
        raise WorkloadFormatError(f"cannot read {what} file {path}: {e.strerror or e}") from e
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise WorkloadFormatError(
            f"{path}: not UTF-8 text (line {line}: byte 0x{data[e.start]:02x} at offset {e.start}): "
            "save the file as UTF-8"
        ) from None


def parse_json(text: str, source: str) -> Any:
    """The value of a JSON text.

    Args:
        text: the JSON text.
        source: where it comes from (a file name), for the message.

    Raises:
        WorkloadFormatError: naming ``source`` for an empty text, malformed JSON, nesting deeper
            than Python's recursion limit, or an integer of more digits than Python converts.
    """
    if not text.strip():
        raise WorkloadFormatError(f"{source}: the file is empty; expected JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadFormatError(f"{source}: not valid JSON: {e}") from None
    except RecursionError:
        raise WorkloadFormatError(
            f"{source}: JSON nested too deeply to read (arrays or objects inside each other)"
        ) from None
    except ValueError as e:  # e.g. an integer beyond sys.get_int_max_str_digits()
        raise WorkloadFormatError(f"{source}: not valid JSON: {e}") from None


def read_json(path: str | Path, what: str = "input") -> Any:
    """The value of a JSON file (:func:`read_text` then :func:`parse_json`).

    Raises:
        WorkloadFormatError: naming the file (see :func:`read_text` and :func:`parse_json`).
    """
    return parse_json(read_text(path, what), str(path))


_TORCHPLACE_KINDS = {"torchplace.plan/1": "a torchplace plan", "torchplace.cluster/1": "a torchplace cluster file",
                     "torchplace.opgraph/1": "a torchplace graph"}


def json_kind(data: Any) -> str | None:
    """What a JSON value read from a user's file is ("a torchplace plan", "a Hugging Face
    config.json", "a Piper workload", ...), when it is a kind torchplace reads or writes, else
    ``None``: for the message when one kind of file is given where another belongs (``solve
    PLAN.json`` said only "field 'nodes' must be a list"; found by fuzzing)."""
    if not isinstance(data, Mapping):
        return None
    fmt = data.get("format")
    if isinstance(fmt, str) and fmt.startswith("torchplace."):
        return _TORCHPLACE_KINDS.get(fmt, f"a torchplace file of format {fmt!r}")
    if "model_type" in data:
        return "a Hugging Face config.json"
    if "mbsInBatch" in data:
        return "a Piper workload"
    if isinstance(data.get("cpus"), list) and isinstance(data.get("fpgas"), list):
        return "a dnn-partitioning split (the loads of its 'cpus' and 'fpgas')"
    if isinstance(data.get("nodes"), list) and isinstance(data.get("edges"), list):
        return "a dnn-partitioning workload"
    return None


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file next to it, then a rename.

    The temporary file is created with the usual permissions (``0o666`` less the umask) and is
    removed if writing fails or is interrupted. A symbolic link is followed (the file it names is
    replaced, the link kept), and a target that exists but is no regular file (``/dev/stdout``,
    ``/dev/null``, a FIFO) is written in place: a rename would put a regular file where the link
    or the device was (as root, ``-o /dev/null`` replaced the device; found by fuzzing).

    Raises:
        UsageError: if ``path`` is a directory.
        OSError: if the directory does not exist or cannot be written.
    """
    given, path = path, Path(os.path.realpath(path))
    if os.path.isdir(given):
        raise UsageError(f"cannot write {given}: it is a directory; give a file name")
    if os.path.exists(given) and not os.path.isfile(given):
        with open(given, "w", encoding="utf-8") as f:
            f.write(text)
        return
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {given}: directory {str(path.parent)!r} does not exist; create it first")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON (one trailing newline) to ``path`` atomically (:func:`write_text`).

    The text is made in full before the file is touched, so data that cannot be written as JSON
    leaves ``path`` as it was.
    """
    write_text(path, json.dumps(data, indent=1) + "\n")
