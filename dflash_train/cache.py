"""Caches that several processes may create at once (8 ranks of one node, or two jobs sharing
`~/.cache/dflash-train`), made exactly once:

- one process builds: an exclusive `fcntl.flock` on a sibling lock file `.<name>.lock` (no
  torch.distributed needed, so separate jobs are covered too); the others wait on it and print a
  line every 10 s naming the builder's pid, never silent;
- the builder writes into a temporary sibling and renames it into place when complete;
- a directory is trusted only with its marker `.complete` (written last: builder pid, host, time
  and each file's size, which readers check). A single file needs no marker: it only ever appears
  by an atomic rename once it is whole.

A cache file built with `verify` gets a content record `.<name>.sha256.json` (its size and its piece
digest, `hashing.py`: sha256 over the sha256s of 64 MiB pieces, hashed by a thread pool; written before
the file is renamed into place) and is hashed in full again on every use: a file edited or corrupted
since it was built is named and rebuilt, never used. A record written by an older version holds the
file's plain `sha256` instead; it is checked with that, so such caches stay valid without a rebuild.

A builder killed mid-build leaves at most a temporary sibling or an unmarked directory; the next
caller (holding the lock, so no one else is building) removes it with a message and rebuilds. A
lock held by a dead process is harmless: the kernel releases flock when its holder dies. Lock files
are left in place on purpose (removing one would let two processes lock different inodes).

`file_sha256` identifies a file by its whole content (a target's weights, a data file), hashed once
per version of the file (path, size, mtime) on each node and cached as a record built the same way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

from dflash_train import atomic, hashing
from dflash_train.hashing import PROGRESS_EVERY_S

MARKER = ".complete"
_POLL_S = 0.25


class CacheBusy(RuntimeError):
    """Another process holds the lock and the caller asked not to wait."""


class NotWritable(OSError):
    """A directory this program writes cannot be created or written (a read-only HOME, say)."""

    readable = True  # cli.py: the message alone, no traceback


def writable_dir(path: Path) -> Path:
    """`path`, created if missing; a NotWritable naming it and the setting that moves it otherwise."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        root = Path(os.environ.get("DFLASH_TRAIN_CACHE", "~/.cache/dflash-train")).expanduser()
        inside = path == root or root in path.parents
        fix = (f"set DFLASH_TRAIN_CACHE to a writable directory (it holds converted GGUF targets and content "
               f"digests; now {root})" if inside else "choose a writable directory for it")
        raise NotWritable(f"{path} cannot be created ({e.strerror or type(e).__name__}: {e.filename or path}): {fix}"
                          ) from None
    return path


def lock_path_of(final: Path) -> Path:
    return final.with_name(f".{final.name}.lock")


def _holder(lock: Path) -> str:
    """The pid the current holder wrote into the lock file ('?' between its truncate and write)."""
    try:
        return lock.read_text().strip() or "?"
    except OSError:
        return "?"


@contextlib.contextmanager
def exclusive(lock: Path, describe: str, wait: bool = True, log=print) -> Iterator[None]:
    """Hold an exclusive flock on `lock` (created if missing) for the block.

    If another process holds it: `wait=False` raises `CacheBusy` naming its pid; `wait=True` polls
    and logs "waiting for <describe> ... pid N, 30 s" at once and every `PROGRESS_EVERY_S`.
    """
    lock = Path(lock)
    writable_dir(lock.parent)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise NotWritable(f"{lock} cannot be created ({e.strerror}): the directory is not writable") from None
    try:
        t0, next_line = time.monotonic(), 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            waited = time.monotonic() - t0
            if not wait:
                raise CacheBusy(f"{describe} is being written by pid {_holder(lock)} (lock {lock}); "
                                "wait for it to finish or use another directory")
            if waited >= next_line:
                log(f"cache: waiting for {describe} being built by pid {_holder(lock)}, {waited:.0f} s")
                next_line += PROGRESS_EVERY_S
            time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock (so does the death of this process)


def _file_sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MARKER}


def write_marker(directory: Path, started: float, note: str = "") -> None:
    """Record a finished build (last write into the directory): who, when, and each file's size."""
    marker = {"pid": os.getpid(), "host": socket.gethostname(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "seconds": round(time.time() - started, 1), "files": _file_sizes(directory)}
    if note:
        marker["note"] = note
    atomic.write_text(directory / MARKER, json.dumps(marker, indent=1) + "\n")


def is_complete(final: Path, directory: bool = True) -> bool:
    """A file: it exists. A directory: its marker parses and every file it lists has its size."""
    final = Path(final)
    if not directory:
        return final.is_file()
    try:
        files = json.loads((final / MARKER).read_text())["files"]
        return all((final / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _remove_leftovers(final: Path, describe: str, accept_unmarked, log) -> bool:
    """Under the lock: drop temporaries of killed builders; adopt or remove an unmarked `final`.
    Returns True when `final` was adopted as complete."""
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        log(f"cache: removing {tmp.name}, left by an interrupted build of {describe}")
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    if not final.exists():
        return False
    if final.is_dir() and accept_unmarked is not None and accept_unmarked(final):
        log(f"cache: adopting {describe} at {final} (made by an older version without a completion marker; "
            "its files are all there)")
        write_marker(final, time.time(), note="adopted: built by an older version")
        return True
    log(f"cache: removing incomplete {describe} at {final} (no valid completion marker: an interrupted "
        "build); rebuilding")
    shutil.rmtree(final) if final.is_dir() else final.unlink()
    return False


def build_once(final: str | Path, build: Callable[[Path], None], describe: str, directory: bool = True,
               accept_unmarked: Callable[[Path], bool] | None = None, log=print, verify: bool = False) -> bool:
    """Make `final` exactly once among all processes; return True if this call built it.

    `build(tmp)` fills the temporary directory `tmp` (`directory=True`) or writes the file `tmp`.
    `accept_unmarked(final)` may vouch for a directory made before markers existed (it then gets
    one); otherwise an unmarked directory is removed and rebuilt. `verify` (a file): its content is
    hashed on every call and compared with the digest recorded when it was built (`content_problem`);
    a file that differs, or has no record, is named and rebuilt.
    """
    final = Path(final)
    if is_complete(final, directory) and not (verify and content_problem(final, log)):
        return False
    with exclusive(lock_path_of(final), describe, log=log):
        if is_complete(final, directory):  # built by the process we waited for, or damaged since
            problem = content_problem(final, log) if verify else ""
            if not problem:
                return False
            log(f"cache: {describe} at {final}: {problem}: it is not what was built; removing it and rebuilding")
            final.unlink()
        if _remove_leftovers(final, describe, accept_unmarked, log):
            return False
        t0 = time.time()
        log(f"cache: building {describe} at {final} (pid {os.getpid()})")
        if directory:
            with atomic.atomic_dir(final) as tmp:
                build(tmp)
                write_marker(tmp, t0)
        else:
            # a verified file is hashed on every use, so it need not wait for the disk (the gpu recipe's 15.5 GB of
            # taps would, on the data phase's critical path)
            atomic.write_with(final, (lambda tmp: _build_recorded(tmp, final, build, log)) if verify else build,
                              durable=not verify)
        log(f"cache: built {describe} in {time.time() - t0:.1f} s")
        return True


def record_path_of(final: Path) -> Path:
    """The content record of a verified cache file: its size and content digest when built."""
    return final.with_name(f".{final.name}.sha256.json")


def _build_recorded(tmp: Path, final: Path, build: Callable[[Path], None], log) -> None:
    """Build into `tmp`, then record its piece digest for `final` (before `tmp` is renamed to `final`,
    so a file in place always has a record; a record without its file is rewritten by the next build)."""
    build(tmp)
    size, piece = tmp.stat().st_size, hashing.PIECE_BYTES
    digest = hashing.piece_digest(tmp, size, log, "just built, for its content record (checked on every use)",
                                  piece_bytes=piece)
    record = {"size": size, hashing.piece_key(piece): digest, "pid": os.getpid(), "host": socket.gethostname(),
              "built": time.strftime("%Y-%m-%dT%H:%M:%S")}
    atomic.write_text(record_path_of(final), json.dumps(record) + "\n")


def _recorded_digest(record: dict) -> tuple[int | None, str]:
    """(piece size, digest) of a content record: a piece digest's key names its piece size; a record
    written by an older version has only "sha256", the plain digest (piece size None)."""
    for key, value in record.items():
        piece = hashing.piece_size_of(key)
        if piece:
            return piece, str(value)
    return None, str(record["sha256"])


def content_problem(final: Path, log=print) -> str:
    """What is wrong with a verified cache file's content ("" when it is the one built): read whole and
    hashed as its record was (a file of 1 GB or more says so, with progress), compared with the record."""
    try:
        record = json.loads(record_path_of(final).read_text())
        want_size, (piece, want) = int(record["size"]), _recorded_digest(record)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"no content record ({record_path_of(final).name}: built by an older version, or the record is damaged)"
    size = final.stat().st_size
    if size != want_size:
        return f"{size} bytes, {want_size} when built"
    why = "to check it against its content record (a verified cache is hashed in full on every use)"
    if piece is None:  # an older version's record: the plain sha256, sequential
        if hashing.sha256_file(final, size, log, why) != want:
            return "its sha256 differs from the one recorded when it was built (edited or corrupted)"
    elif hashing.piece_digest(final, size, log, why, piece_bytes=piece) != want:
        return (f"its piecewise sha256 differs from the one recorded when it was built (edited or corrupted; "
                f"{hashing.piece_key(piece)})")
    return ""


# ---------------------------------------------------------------------------------------------
# Content digests: a file's sha256, computed once per version of the file on this node


def digest_cache_dir() -> Path:
    """Where digests are kept: `$DFLASH_TRAIN_CACHE/sha256` (node-local, like the GGUF conversions)."""
    return Path(os.environ.get("DFLASH_TRAIN_CACHE", "~/.cache/dflash-train")).expanduser() / "sha256"


def file_sha256(path: str | Path, log=print) -> str:
    """The sha256 of a file's whole content, computed once per (path, size, mtime) on this node:
    the digest is cached under `digest_cache_dir()`, and concurrent callers (the ranks of a node)
    wait for the one that hashes (`build_once`)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    record = digest_cache_dir() / f"{key}.json"
    why = "once for this version of the file (path, size, mtime); later runs read the cached digest"

    def build(tmp: Path) -> None:
        tmp.write_text(json.dumps({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                   "sha256": hashing.sha256_file(path, stat.st_size, log, why)}) + "\n")

    def quiet(line: str) -> None:  # the hashing says enough; waiting for another rank's is still said
        if not line.startswith(("cache: building", "cache: built")):
            log(line)

    build_once(record, build, f"the sha256 of {path.name}", directory=False, log=quiet)
    try:
        return json.loads(record.read_text())["sha256"]
    except (OSError, ValueError, KeyError):  # a damaged record: hash again, and replace it
        record.unlink(missing_ok=True)
        return file_sha256(path, log)
