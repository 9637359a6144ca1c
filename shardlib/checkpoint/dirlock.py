"""One run per checkpoint directory: a lock file that names its owner.

Two runs writing one directory corrupt each other quietly (orbax skips saves, renames
collide, temporary directories are left behind), so a run takes ``<dir>/.shardlib-lock``
before it reads or writes anything there, and a second run is refused with the owner's
host and PID. The lock is a POSIX record lock (``fcntl.lockf``, which NFS also honours) on
a file holding the owner's identity: the kernel drops it when the owner dies however it
dies, so a lock left by a killed run on this host is taken over without asking anyone. A
lock file naming *another* host is refused even when the lock itself is free, because
some network filesystems do not share locks between hosts; the message says how to clear
it. The file is removed on a clean exit.

Only process 0 of a multi-process run takes the lock; the others learn its verdict through
the coordination service's key-value store, so every rank refuses together.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import socket
import time
from pathlib import Path

from shardlib.checkpoint.store import CheckpointError

LOCK_NAME = ".shardlib-lock"
KEY_PREFIX = "shardlib/dirlock"
VERDICT_TIMEOUT_MS = 120_000  # process 0 only creates a file before answering
_RUNS = itertools.count()  # as in preempt.py: every process counts its runs the same way
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


def check_directory(directory: Path) -> None:
    """A directory the run can write (created if missing); else a one-line error."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"checkpoint_dir={str(directory)!r} is a file, not a directory. Fix: point "
            "checkpoint_dir at a directory, or at a path that does not exist yet."
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(
            f"checkpoint_dir={str(directory)!r} cannot be created ({type(err).__name__}: "
            f"{err.strerror or err}). Fix: choose a writable checkpoint_dir."
        ) from None


def _owner(text: str) -> str:
    try:
        owner = json.loads(text)
        return f"host {owner['host']}, pid {owner['pid']}, since {owner['since']}"
    except (ValueError, KeyError, TypeError):
        return "an unknown owner (the lock file is empty or unreadable)"


class DirectoryLock:
    """``with DirectoryLock(dir):`` holds ``dir/.shardlib-lock`` for the block."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.recovered: str | None = None
        """The previous owner when its lock was left behind by a dead run (else None)."""
        self._fd: int | None = None

    def _refuse(self, owner: str, why: str = "") -> CheckpointError:
        return CheckpointError(
            f"checkpoint_dir={str(self.directory)!r} is in use by another run ({owner}){why}. "
            "Fix: wait for that run or stop it, or choose another checkpoint_dir"
            + (f"; if it is dead, delete {self.path}." if why else ".")
        )

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise CheckpointError(
                f"checkpoint_dir={str(self.directory)!r} is not writable ({type(err).__name__}: "
                f"{err.strerror or err}). Fix: make it writable, or choose another checkpoint_dir."
            ) from None

    def acquire(self) -> DirectoryLock:
        check_directory(self.directory)
        locked = True
        while True:
            fd = self._open()
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in _NO_LOCKS:  # no locks here: the owner's record decides alone
                    locked = False
                    break
                text = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                raise self._refuse(_owner(text)) from None
            try:  # the owner may have removed the file between our open and our lock
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if previous:
            host = _json_field(previous, "host")
            if host != socket.gethostname():
                os.close(fd)
                raise self._refuse(_owner(previous), ", which cannot be checked from this host")
            pid = _json_field(previous, "pid")  # with a lock held, the kernel says it is dead
            if not locked and isinstance(pid, int) and pid != os.getpid() and _alive(pid):
                os.close(fd)
                raise self._refuse(_owner(previous))
            self.recovered = _owner(previous)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:  # unlink before unlocking; a waiter that opened the old file sees it is gone
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _json_field(text: str, name: str):
    try:
        return json.loads(text).get(name)
    except (ValueError, AttributeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class RunLock:
    """The lock for a run of one or more processes (process 0 holds it, all see its verdict)."""

    def __init__(self, directory: str | Path, say=print) -> None:
        self.lock = DirectoryLock(directory)
        self.say = say
        self._key = f"{KEY_PREFIX}/{next(_RUNS)}"

    def _acquire(self) -> DirectoryLock:
        self.lock.acquire()
        if self.lock.recovered:
            self.say(f"took over {self.lock.path} from a run that is gone ({self.lock.recovered})")
        return self.lock

    def __enter__(self) -> DirectoryLock:
        from shardlib.distributed.runtime import coordination_client

        client = coordination_client()
        if client is None:
            return self._acquire()
        import jax

        if jax.process_index() == 0:
            try:
                self._acquire()
            except Exception as err:
                client.key_value_set(self._key, str(err) or type(err).__name__)
                raise
            client.key_value_set(self._key, "ok")
            return self.lock
        verdict = client.blocking_key_value_get(self._key, VERDICT_TIMEOUT_MS)
        if verdict != "ok":
            raise CheckpointError(verdict)
        return self.lock

    def __exit__(self, *exc) -> None:
        self.lock.release()
