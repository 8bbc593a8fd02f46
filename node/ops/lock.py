"""One daemon per HOME: an advisory lock on `HOME/daemon.lock`.

flock is released by the kernel when the process dies, so a crashed daemon never leaves a lock that
needs hand-cleaning; the file's content (the pid) is only there to make the error message useful.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from node.config.home import Home


class LockError(Exception):
    pass


class HomeLock:
    def __init__(self, home: Path) -> None:
        self.path = Home(home).lock
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.read(fd, 32).decode().strip() or "?"
            finally:
                os.close(fd)
            raise LockError(
                f"another starling daemon (pid {pid}) is already running on {self.path.parent}; "
                "stop it first, or use another --home"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> HomeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
