"""One run per run directory: `train` holds `train.out_dir/.dflash-train.lock` for its whole life.

Two runs into one directory would interleave their metrics and overwrite each other's checkpoints,
both ending OK. The main drafter rank (the one that writes the directory) takes an exclusive
`fcntl.flock` on the lock file before anything is read or written, and records in it who holds it
(pid, host, start time, command). A second run fails at once with that record. The kernel releases
a flock when its holder dies, however it dies, so a lock left by a killed run is never in the way:
the next run takes it over and says whose it was (the record it finds). On a filesystem without
locks the run goes on with a warning that nothing prevents a second run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

LOCK_NAME = ".dflash-train.lock"
_BUSY = (errno.EAGAIN, errno.EACCES)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirectoryBusy(RuntimeError):
    """Another run holds the run directory."""

    readable = True  # cli.py: the message alone, no traceback


def _record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)}


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode(errors="replace").strip()
    try:
        return json.loads(text) if text else None
    except ValueError:
        return {"pid": "?", "host": "?", "started": "?", "command": text[:200]}


def _who(record: dict | None) -> str:
    if not record:
        return "another process (no record yet: it is starting)"
    return (f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')} "
            f"({record.get('command')})")


def _write(fd: int, record: dict | None) -> None:
    os.ftruncate(fd, 0)
    if record is not None:
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)


@contextlib.contextmanager
def held(out_dir: str | Path, log=print, enabled: bool = True) -> Iterator[None]:
    """Hold the run directory for the block (see the module doc); `enabled=False` (a rank that does
    not write the directory) holds nothing. Raises `RunDirectoryBusy` naming the holder."""
    if not enabled:
        yield
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _BUSY:
                raise RunDirectoryBusy(
                    f"train.out_dir {out_dir} is in use by another run: {_who(_read(fd))} (lock {path}); wait "
                    "for it to end, stop it, or give this run another train.out_dir") from None
            if e.errno not in _UNSUPPORTED:
                raise
            log(f"WARNING run lock: {path}: this filesystem has no file locks ({e.strerror}): nothing stops a "
                "second run from writing into this directory at the same time")
            yield
            return
        previous = _read(fd)
        if previous:
            log(f"run lock: taking over {path} from {_who(previous)}, which is no longer running (it ended "
                "without releasing it: killed, or its machine went down)")
        _write(fd, _record())
        try:
            yield
        finally:
            _write(fd, None)  # released normally: the next run has nobody to take over from
    finally:
        os.close(fd)  # releases the flock (so does this process's death)
