"""One trainer per run directory: an advisory lock held for the life of `marinctl train`.

Two trainers on one run dir would interleave checkpoints and metrics.jsonl lines and silently ruin
both runs, so the second is refused at once (exit 2) with the holder's host and pid. The lock is a
`flock` on RUN_DIR/.marinctl.lock: the kernel drops it when the holder dies, even on SIGKILL or OOM,
so a stale lock is never a problem to clear by hand — the next trainer takes it atomically and says
whose it was. The file's text (host, pid, start time) is only information for the operator; the lock
itself is the kernel's. flock works across hosts on NFSv4 and Lustre (as POSIX locks), the shared
file systems a cluster run dir lives on.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from marinctl.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".marinctl.lock"


class RunDirInUse(UserError):
    """Another live process holds the run directory."""


class RunLock:
    """`with RunLock(run_dir):` — exclusive use of a run directory by this process."""

    def __init__(self, run_dir: Path, what: str = "marinctl train"):
        self.path = Path(run_dir) / LOCK_FILE
        self.what = what
        self._fd: int | None = None
        self._made_dir = False

    def acquire(self) -> RunLock:
        self._made_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise RunDirInUse(
                f"{self.path.parent}: in use by {holder}; wait for it to finish or stop it "
                f"(a second trainer would corrupt its checkpoints and metrics.jsonl)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        previous = _read(fd)
        if previous and previous.get("pid") is not None:  # its holder died without releasing: the kernel did
            log.warning("%s: taking over the lock of %s (no longer running)", self.path.parent, _describe(previous))
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "what": self.what}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty file: released cleanly, nobody to "take over" from
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
        if self._made_dir and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
            # A start refused before writing anything (bad mesh, memory) leaves no half-made run dir behind.
            self.path.unlink(missing_ok=True)
            self.path.parent.rmdir()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another process (holder unknown)"
    what, pid, host, since = (holder.get(k) for k in ("what", "pid", "host", "since"))
    return f"{what or 'a process'} pid {pid} on host {host} since {since}"
