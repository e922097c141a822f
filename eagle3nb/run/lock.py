"""One live run per output folder: ``run.lock`` held with flock for the run's life, its pid inside."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import psutil

from eagle3nb.errors import UserError
from eagle3nb.run import LOCK_FILE


class RunLocked(UserError, RuntimeError):
    """Another live run holds this output folder."""


def lock(out_dir: Path, fd: int | None = None) -> int:
    """Hold ``run.lock`` (flock) for this process's life; ``fd`` is one inherited from a detaching parent."""
    path = out_dir / LOCK_FILE
    if fd is None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    elif os.fstat(fd).st_ino != path.stat().st_ino:
        raise RunLocked(f"--lock-fd {fd} is not {path}; start runs without --lock-fd (it is internal)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = path.read_text().strip() or "?"
        os.close(fd)
        raise RunLocked(
            f"{out_dir} is in use by run pid {holder} (it holds {path}); refusing to start a second run there. "
            f"Follow it with `eagle3nb status {out_dir}`, wait for it, or stop it with `kill {holder}`.") from None
    os.set_inheritable(fd, False)  # an fd handed over by a detaching parent goes no further
    write_pid(fd, os.getpid())
    return fd


def write_pid(fd: int, pid: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{pid}\n".encode(), 0)


def pid_alive(pid: int | None, started: float | None = None) -> bool:
    """True if ``pid`` is a live process (and the same one: its start time matches when recorded)."""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(p.create_time() - started) < 1.0
    except psutil.Error:
        return False

