"""Files the library writes: output paths opened before any work starts, and atomic writes that
never leave a half-written target and clean up after writers that died.

A write goes to `.NAME.<pid>.<random>.tmp` beside the target (a file, or a directory for a model),
held under an exclusive lock (flock) while it is written, then fsynced and renamed over the target.
`check_output` creates that temp file at the boundary, before any work (asking the file system,
not `os.access`, which says yes to root wherever it looks), and the write uses it; one the process
never wrote is removed at its exit. A temp file of the same target whose lock nobody holds belongs
to a writer that died (kill -9, a power cut): the next command that writes the target, or the write
itself, removes it. Two live writers never remove each other's.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from larqlpy.errors import LarqlError

LOCK = ".lock"  # inside a temp directory: the file its writer holds locked
# The most the library reads of an input the user names (docs/cli.md). A read takes at most one byte
# more, so /dev/zero, a FIFO that never ends or a 10 GB file is refused at the limit, not read whole.
TEXT_LIMIT = 1 << 20  # a JSON Schema, grammar, tools list, chat template or rules file
PROMPT_LIMIT = 64 << 20  # a prompt or a text to measure on, from a file or stdin
BATCH_LIMIT = 1 << 30  # a batch's input (read whole, like any input here)
_CHUNK = 1 << 20  # read in pieces: a large limit is not allocated up front
_OPENED: dict[Path, tuple[Path, int]] = {}  # target -> its temp file, and the descriptor holding its lock


def check_output(path: str | os.PathLike, what: str, inputs: Sequence[str | os.PathLike] = (),
                 directory: bool = False) -> Path:
    """Refuse, before any work, an output path that cannot be written: an existing directory (or,
    with `directory`, an existing file), a missing parent, one of the `inputs`, or a place no file can
    be created (the temp file the write will use is created now: `atomic_path` takes it). The stale
    temp files of dead writers of `path` are removed. `what` names the path in the refusal (a
    parameter in backticks, or a file)."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir() and not directory:
        raise LarqlError(f"{what} {path}: is a directory")
    if path.exists() and directory and not path.is_dir():
        raise LarqlError(f"{what} {path}: is a file, not a directory")
    if not parent.is_dir():
        raise LarqlError(f"{what} {path}: directory {parent} does not exist")
    for given in inputs:
        if given is not None and _same(path, Path(given)):
            raise LarqlError(f"{what} {path}: is also an input; writing it would destroy what is read")
    remove_stale(path)
    if directory:  # what is written goes inside it (or it is made): a file must be creatable there
        probe = temp_name((path if path.is_dir() else parent) / "probe")
        os.close(_open_temp(probe, what, path))
        probe.unlink()
    elif path.resolve() not in _OPENED:
        tmp = temp_name(path)
        _OPENED[path.resolve()] = (tmp, _open_temp(tmp, what, path))
    return path


def check_room(path: str | os.PathLike, need: int, what: str) -> None:
    """Refuse, before any work, a write of about `need` bytes beside `path` that the disk cannot hold
    (a tenth more kept free): a full disk found halfway costs the minutes spent and the temp files."""
    parent = Path(path).parent if str(Path(path).parent) else Path(".")
    free = shutil.disk_usage(parent).free
    if need + need // 10 > free:
        raise LarqlError(f"{what} {path}: needs about {need / 2**30:.1f} GiB, and {parent} has "
                         f"{free / 2**30:.1f} GiB free")


def _open_temp(tmp: Path, what: str, path: Path) -> int:
    """The temp file `tmp`, created and locked; a refusal naming `path` when no file can be made there."""
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    except OSError as e:
        raise LarqlError(f"{what + ' ' if what else ''}{path}: cannot be written ({e.strerror or e})") from None
    if not _lock(fd):
        os.close(fd)
        raise LarqlError(f"{path}: cannot lock its temp file {tmp.name}")
    return fd


@atexit.register
def _remove_unwritten() -> None:
    """Temp files opened for outputs the process never wrote (its work failed first)."""
    for tmp, fd in _OPENED.values():
        Path(tmp).unlink(missing_ok=True)
        os.close(fd)
    _OPENED.clear()


def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def remove_stale(path: Path, pattern: str | None = None) -> list[Path]:
    """Remove the temp files (and temp directories) of `path` that no live writer holds (with
    `pattern`, those of every target in directory `path` that match it, e.g. ".*.lqkv.*.tmp")."""
    removed = []
    for tmp in (path.glob(pattern) if pattern else path.parent.glob(f".{path.name}.*.tmp")):
        lock_path = tmp / LOCK if tmp.is_dir() else tmp
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except OSError:
            if tmp.is_dir():  # died before it made its lock file
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
            continue
        try:
            if _lock(fd):  # nobody holds it: its writer is gone
                if tmp.is_dir():
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink(missing_ok=True)
                removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, what: str = "") -> Iterator[Path]:
    """A temp path to write `path` through (for writers that take a file name): it replaces `path`
    only once the block has finished (fsynced, renamed, the directory fsynced); if the block fails,
    `path` is as it was."""
    path = Path(path)
    opened = _OPENED.pop(path.resolve(), None)
    if opened is not None:  # check_output made it at the boundary
        tmp, fd = opened
    else:
        remove_stale(path)
        tmp = temp_name(path)
        fd = _open_temp(tmp, what, path)
    try:
        yield tmp
        _settle(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)  # the lock goes with it
    _fsync_dir(path.parent)


@contextmanager
def atomic_write(path: str | os.PathLike, what: str = "") -> Iterator[BinaryIO]:
    """A binary file to write `path` through, as `atomic_path`."""
    with atomic_path(path, what) as tmp, open(tmp, "wb") as f:
        yield f
        f.flush()


def _settle(f: Path) -> None:
    """A written file made durable and as readable as this module creates its own (0644), through its
    name: a writer that makes its own temp file and renames it over `f` (safetensors' save_file)
    leaves another inode than the one opened here, at 0600, which other users of a shared models
    directory cannot read."""
    os.chmod(f, 0o644)
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_directory(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """A temp directory to fill; renamed to `path` when the block finishes (an existing `path` is
    replaced only with `replace`)."""
    path = Path(path)
    remove_stale(path)
    tmp = temp_name(path)
    tmp.mkdir(mode=0o755)
    fd = os.open(tmp / LOCK, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        _lock(fd)
        yield tmp
        os.unlink(tmp / LOCK)
        for f in tmp.rglob("*"):
            if f.is_file():
                _settle(f)
        if path.exists() and replace:
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def utf8(data: bytes | str, where: str) -> str:
    """Text that must be UTF-8, or a one-line refusal naming where the first bad byte is. A str
    from argv carries undecodable bytes as surrogate escapes; they are refused the same way."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
            return data
        except UnicodeEncodeError:
            try:
                data = data.encode("utf-8", "surrogateescape")  # argv's undecodable bytes
            except UnicodeEncodeError:  # a lone surrogate, as a JSON "\ud800" escape carries
                json_text(data, where)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        at = f"line {line}, " if b"\n" in data[:e.start] else ""
        raise LarqlError(f"{where}: not valid UTF-8 "
                         f"(byte 0x{data[e.start]:02x} at {at}byte offset {e.start})") from None


def json_text(text: str, where: str) -> str:
    """A string from JSON, which UTF-8 text can hold: a lone surrogate (a "\ud800" escape) is refused."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        raise LarqlError(f"{where}: not valid text (a lone surrogate U+{ord(text[e.start]):04X} at character "
                         f"{e.start}, which no UTF-8 text can hold)") from None


def check_strings(value, where: str) -> None:
    """Every string in a parsed JSON value (keys included) must be text UTF-8 can carry: refuse the
    first that is not, naming where it is (`where`, then [i] and .key down to it)."""
    if isinstance(value, str):
        json_text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            json_text(k, where)
            check_strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_strings(v, f"{where}[{i}]")


def check_fields(obj: dict) -> None:
    """`check_strings` over each field of a JSON object (a request body, a batch line), naming the
    field as a parameter: a JSON "\ud800" escape is a str no tokenizer or template takes."""
    for key, value in obj.items():
        check_strings(value, f"`{key}`")


def read_bytes(path: str | os.PathLike, what: str = "", limit: int = TEXT_LIMIT) -> bytes:
    """A file the user named, or a one-line refusal (missing, a directory, unreadable, more than
    `limit` bytes) that names it (after `what`, the flag or argument it came in, when given)."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    if path.is_dir():
        raise LarqlError(f"{name}: is a directory")
    try:
        if path.is_file() and path.stat().st_size > limit:  # a regular file's size is known: refused unread
            raise LarqlError(too_large(name, limit))
        with open(path, "rb") as f:
            return read_limited(f, limit, name)
    except OSError as e:
        raise LarqlError(f"{name}: {e.strerror or e}") from None


def read_limited(f, limit: int, name: str) -> bytes | str:
    """What an open file (or stdin) holds, at most `limit` bytes: it is read to limit + 1 and
    refused past that. st_size is not asked, since /dev/zero and a pipe report 0."""
    chunks, total = [], 0
    while total <= limit:
        chunk = f.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > limit:
        raise LarqlError(too_large(name, limit))
    return chunks[0][:0].join(chunks) if chunks else b""


def too_large(name: str, limit: int) -> str:
    size = f"{limit >> 30} GiB" if limit % (1 << 30) == 0 else f"{limit >> 20} MiB" if limit % (1 << 20) == 0 \
        else f"{limit:,} bytes"
    return f"{name}: larger than {size}, the limit for this input"


def read_text(path: str | os.PathLike, what: str, limit: int = TEXT_LIMIT) -> str:
    """A UTF-8 text file the user named, or a one-line refusal (as read_bytes, or not UTF-8)."""
    return utf8(read_bytes(path, what, limit), f"{what} {path}" if what else str(path))


def is_gguf(path: str | os.PathLike) -> bool:
    """A file that starts with the GGUF magic (a directory, or anything else, is not)."""
    try:
        with open(path, "rb") as fh:
            return Path(path).is_file() and fh.read(4) == b"GGUF"
    except OSError:
        return False
