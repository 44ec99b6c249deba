"""One writer per output folder: a lock file that the operating system releases when its process dies.

Two ``train`` runs (or two batches) writing one output folder would interleave their
checkpoints, logs and tables. :class:`FolderLock` holds an exclusive ``flock`` on
``<folder>/.acl_lab.lock`` for as long as the writer runs; a second writer is refused at
once with an :class:`~acl_lab.errors.AclLabError` naming the holder (pid, command, host,
start time). The lock belongs to the open file, so the kernel drops it when the process
exits in any way, SIGKILL included: a dead run never leaves the folder stuck. The file itself
stays (deleting it would race with a writer that just opened it); it is empty when free.

Where ``flock`` is unavailable (Windows, or a network filesystem that refuses it) the folder
is used without a lock, after a warning.

:func:`held` is the waiting kind, for a short read-modify-write of one shared file (e.g. a
pack's ``plan.json`` written by shards side by side): it blocks until it holds an exclusive
``flock`` on a given lock file. Where ``fcntl`` is missing it holds nothing and says nothing
(one writer is then the user's business).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from .errors import AclLabError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".acl_lab.lock"
F = TypeVar("F", bound=Callable[..., Any])


class FolderLock:
    """``with FolderLock(folder, "train"):`` makes this process the only writer of ``folder`` (created if needed)."""

    def __init__(self, folder: str | Path, command: str) -> None:
        self.folder = Path(folder).expanduser()
        self.command = command
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.folder / LOCK_NAME

    def __enter__(self) -> "FolderLock":
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise AclLabError(f"Output directory {str(self.folder)!r} is not writable ({exc.strerror or exc}). "
                              "Fix: choose another --output-dir (or OUTPUT_DIR) that you can write to.") from None
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise AclLabError(
                    f"Output folder {str(self.folder)!r} is in use by another acl_lab {holder}. Two writers would mix "
                    f"their files. Fix: wait for that run to finish (or stop it), or choose another output folder."
                ) from None
            except OSError as exc:
                warnings.warn(f"Cannot lock {self.path} ({exc.strerror or exc}); make sure no other run writes "
                              f"{self.folder} at the same time.", RuntimeWarning, stacklevel=2)
        info = {"pid": os.getpid(), "command": self.command, "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # free: no holder to name
            os.close(self._fd)  # closing the file releases the flock
            self._fd = None


@contextlib.contextmanager
def held(lock_path: str | Path) -> Iterator[None]:
    """``with held(path):`` waits for, then holds, an exclusive ``flock`` on the file ``lock_path`` (created if
    needed, never deleted), released when the block ends. Without ``fcntl`` (Windows) it holds nothing, silently."""
    with open(lock_path, "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # blocks until the other holder's block ends (or its process dies)
        yield


def _read_holder(fd: int) -> str:
    """'train (pid 123 on host, since ...)' from the lock file, or 'process' if it says nothing readable."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return (f"{info['command']} (pid {info['pid']} on {info['host']}, running since {info['started']})"
                if isinstance(info, dict) else "process")
    except (OSError, ValueError, KeyError):
        return "process"


def one_writer(command: str, folder_of: Callable[..., str | Path | None]) -> Callable[[F], F]:
    """Decorate a function that writes one folder so that it runs under :class:`FolderLock`.

    ``folder_of`` gets the function's arguments and returns the folder, or ``None`` when the
    arguments are invalid (the function then runs unlocked and reports the problem itself).
    """
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            folder = folder_of(*args, **kwargs)
            if folder is None:
                return fn(*args, **kwargs)
            with FolderLock(folder, command):
                return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate


def train_output_dir(config: Any, *_: Any, **__: Any) -> Path | None:
    """The output folder of ``train(config, ...)``, or ``None`` if ``config`` is not a valid config, or in a
    process of torchrun other than rank 0 (rank 0 is the one writer; the others write nothing)."""
    from .config import TrainConfig

    if os.environ.get("RANK", "0") != "0":
        return None

    try:
        cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
        cfg.validate()
    except (AclLabError, TypeError, ValueError):
        return None
    return Path(cfg.output_dir).expanduser()
