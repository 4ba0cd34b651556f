"""The coordinator's data dir: the names of its files, and the lock that gives it to one process.

Two coordinators on one data dir would share one identity and one SQLite store and overwrite each
other's endpoint file. The lock is an OS file lock (``flock``) on ``coordinator.lock``: the kernel drops
it when the holder exits, SIGKILL included, so a crashed coordinator never leaves the dir unusable.

Example::

    lock = DataDirLock.acquire(Path("~/.swarm/coordinator").expanduser())
    ...
    lock.release()
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from protocols.errors import ConfigError

STORE_FILE = "coordinator.db"
LOCK_FILE = "coordinator.lock"


class DataDirLock:
    """An exclusive hold on a coordinator data dir for the life of this process (or until ``release``)."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        """Lock ``data_dir`` (created if missing); ConfigError naming the dir and the holder's pid if a
        live process holds it."""
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            path = data_dir / LOCK_FILE
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ConfigError(f"cannot use the data dir {data_dir}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"the data dir {data_dir} is in use by another coordinator (pid {holder}); stop it, or "
                "pass another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
