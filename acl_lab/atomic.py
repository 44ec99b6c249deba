"""Durable file writes: a file is either its old whole self or its new whole self, never half of each.

Every file the kit writes (checkpoints, ``metrics.json``, ``config.json``, ``history.jsonl``,
batch tables, evidence CSVs, figures) goes through this module, because a process can die
at any instant (the out-of-memory killer, a recycled Colab runtime, SIGKILL) and a full disk
can fail any write:

* :func:`target` yields a temporary path beside the file; when the block ends it flushes the
  temporary to disk (``fsync``) and renames it over the file with ``os.replace``, which is
  atomic. A reader therefore never sees a half-written file, and a failed or killed write
  leaves the old file as it was (and at most a stray ``*.tmp-<pid>`` that the next write of
  the same file removes).
* :func:`replace_folder` does the same for a checkpoint folder: the new folder is written
  whole under ``<name>.tmp``, then swapped in. Between the two renames of the swap the old
  folder is kept as ``<name>.old``; :func:`restore_folder` puts it back if a kill fell there,
  so a checkpoint folder is always complete or absent.
* :func:`append_line` appends one log line and flushes it; :func:`read_jsonl` reads such a log
  and drops a torn last line (a kill in the middle of an append), which resume recomputes.
* A write that fails because the disk is full or a file-size limit is hit (ENOSPC, EFBIG,
  EDQUOT) becomes one :class:`~acl_lab.errors.AclLabError` that names the file and the fix.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import AclLabError

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
# libraries that write files themselves (safetensors' Rust writer) report the OS error only as text
_DISK_FULL_TEXT = re.compile(r"os error (%s)\b|No space left on device|File too large|Disk quota exceeded"
                             % "|".join(str(e) for e in sorted(DISK_FULL_ERRNOS)))


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed write for lack of space (ENOSPC, EFBIG from a file-size limit, EDQUOT)."""
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return True
    return bool(_DISK_FULL_TEXT.search(str(exc)))


def disk_full_error(path: str | Path, exc: BaseException) -> AclLabError:
    """The one message for a write that ran out of space: what failed, what is intact, what to do."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0][:200]
    return AclLabError(f"Writing {str(path)!r} failed: the disk is full or a file-size limit was reached ({why}). "
                       f"The previous version of {Path(path).name} (if any) is kept intact. Fix: free disk space or "
                       "choose an --output-dir (OUTPUT_DIR) on a bigger disk, then run again with --resume.")


def fsync_dir(folder: str | Path) -> None:
    """Flush a folder's entries (a rename inside it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on a folder
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Flush a file's contents to disk."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _remove_stale_temps(path: Path) -> None:
    """Delete temporaries of ``path`` left by writers that died (those of live processes are theirs)."""
    for stale in path.parent.glob(f"{path.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            stale.unlink()


@contextlib.contextmanager
def target(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; on success it replaces ``path`` atomically.

    Use it for writers that want a file name (``safetensors.save_file``, ``DataFrame.to_csv``,
    ``Figure.savefig``). If the block raises, the temporary is removed and ``path`` is untouched;
    a full disk becomes an :class:`AclLabError` (see :func:`disk_full_error`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    tmp = _temp_name(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, Exception) and is_disk_full(exc):
            raise disk_full_error(path, exc) from None
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically (see :func:`target`)."""
    path = Path(path)
    with target(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically (see :func:`target`)."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any, **dumps_kwargs: Any) -> Path:
    """Replace ``path`` with ``obj`` as JSON plus a final newline, atomically."""
    return write_text(path, json.dumps(obj, **dumps_kwargs) + "\n")


def append_line(path: str | Path, line: str) -> None:
    """Append one line (a newline is added) to a log and flush it to disk.

    An append cannot be atomic, but a kill can only tear the *last* line, which
    :func:`read_jsonl` drops; everything written before stays.
    """
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(path, exc) from None
        raise


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines log; a torn last line (a write cut short by a kill) is dropped.

    Any other line that is not a JSON object means the file was damaged or edited by hand,
    and raises an :class:`AclLabError` naming the line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AclLabError(f"Log {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}). Fix: restore it, "
                          "or start the run again with --overwrite.") from None
    lines = text.split("\n")[:-1]  # what follows the last newline is a torn append (or nothing)
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            raise AclLabError(f"Line {i} of {str(path)!r} is not a JSON object ({line[:60]!r}). Fix: restore the "
                              "file, delete that line, or start the run again with --overwrite.")
        rows.append(row)
    return rows


def restore_folder(folder: str | Path) -> None:
    """Finish or undo a folder swap that a kill interrupted, so ``folder`` is complete or absent.

    ``<folder>.old`` exists only between the two renames of :func:`replace_folder` (when the
    folder itself is briefly absent) and while it is being deleted after them; ``<folder>.tmp``
    is a new version that was not swapped in yet, so it may be incomplete and is dropped.
    """
    folder = Path(folder)
    old, tmp = folder.with_name(folder.name + ".old"), folder.with_name(folder.name + ".tmp")
    if old.exists():
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, folder)
            fsync_dir(folder.parent)
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(folder: str | Path, writer: Callable[[Path], None]) -> Path:
    """Write a folder whole with ``writer(tmp_folder)``, flush it, and swap it in for ``folder``.

    If ``writer`` fails (or the disk fills up), the temporary folder is removed and the old
    ``folder`` is untouched. Readers should call :func:`restore_folder` first (the trainer does
    when it starts), which repairs the one moment of a swap when ``folder`` is absent.
    """
    folder = Path(folder)
    restore_folder(folder)
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    try:
        tmp.mkdir(parents=True)
        writer(tmp)
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and is_disk_full(exc):
            raise disk_full_error(folder, exc) from None
        raise
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    fsync_dir(folder.parent)
    shutil.rmtree(old, ignore_errors=True)
    return folder
