"""Whole-file digests with progress: the plain sha256 (a target's identity, `cache.file_sha256`) and the
piece digest that verified cache files are recorded and checked with (`cache.build_once(verify=True)`).

The piece digest of a file of `size` bytes, for a piece size P (`PIECE_BYTES`, 64 MiB, unless a record
names another): the file is cut into ceil(size / P) pieces, bytes [i*P, min((i+1)*P, size)); each piece's
sha256 is computed (32 raw bytes); the digest is the hex sha256 of those raw digests concatenated in file
order. An empty file has no pieces: its digest is sha256 of nothing. A content record stores it under
`piece_key(P)` ("sha256_pieces_64MiB"), so a record says which scheme and piece size made it.

Why pieces: one sha256 is sequential (0.83 GB/s on the H200 machine: 18 s for a 14.6 GB taps file, on
every use of the cache). The pieces are independent, so a thread pool hashes them at once: hashlib
releases the GIL while it hashes a large buffer, and each thread reads its piece with `os.preadv` at the
piece's offset (no shared file position), 1 MiB at a time into a buffer of its own (`READ_BYTES`: the
bytes are still in the core's cache when sha256 reads them), so memory stays at threads x 1 MiB.
Progress lines come from the calling thread only.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROGRESS_EVERY_S = 10.0
ANNOUNCE_BYTES = 1 << 30  # files this large get a line before hashing, progress lines and a closing line
HASH_CHUNK = 8 << 20  # the sequential sha256 reads this much at a time
PIECE_BYTES = 64 << 20  # the piece digest's piece size when a record is written
READ_BYTES = 1 << 20  # each thread reads its piece this much at a time: about a core's L2 cache
MAX_THREADS = 8  # leaves cores to the run's own CPU work (loaders, compile) on a 16-core GPU machine

_KEY = re.compile(r"sha256_pieces_(\d+)(MiB|KiB|B)")
_UNITS = {"MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


def _size_name(piece_bytes: int, space: str = " ") -> str:
    """64 MiB, 4 KiB, 1000 B: the largest unit that divides the size exactly."""
    unit = next(u for u in ("MiB", "KiB", "B") if piece_bytes % _UNITS[u] == 0)
    return f"{piece_bytes // _UNITS[unit]}{space}{unit}"


def piece_key(piece_bytes: int) -> str:
    """The record key of the piece digest with pieces of `piece_bytes`: "sha256_pieces_64MiB"."""
    return f"sha256_pieces_{_size_name(piece_bytes, '')}"


def piece_size_of(key: str) -> int | None:
    """The piece size a record key names (`piece_key`'s inverse); None for any other key."""
    found = _KEY.fullmatch(key)
    return int(found.group(1)) * _UNITS[found.group(2)] if found else None


def hash_threads() -> int:
    """Threads for the piece digest: the CPUs this process may run on, at most MAX_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


class _Progress:
    """The lines of one hashing, files of ANNOUNCE_BYTES or more only: one before, one every
    PROGRESS_EVERY_S (share done, rate, ETA), one at the end. Called by one thread."""

    def __init__(self, path: Path, size: int, log, why: str, how: str):
        self.path, self.size, self.log, self.done = path, size, log, 0
        self.loud = size >= ANNOUNCE_BYTES
        self.t0, self.next_line = time.monotonic(), PROGRESS_EVERY_S
        if self.loud:
            log(f"hashing {path} ({size / 1e9:.1f} GB, {how}) {why}")

    def add(self, n: int) -> None:
        self.done += n
        waited = time.monotonic() - self.t0
        if self.loud and waited >= self.next_line:
            rate = self.done / waited
            self.log(f"hashing {self.path.name}: {self.done / self.size:.0%} of {self.size / 1e9:.1f} GB, "
                     f"{rate / 1e9:.2f} GB/s, ETA {(self.size - self.done) / max(rate, 1.0):.0f} s")
            self.next_line += PROGRESS_EVERY_S

    def close(self) -> None:
        if self.loud:
            seconds = time.monotonic() - self.t0
            self.log(f"hashed {self.path.name}: {self.done / 1e9:.1f} GB in {seconds:.1f} s "
                     f"({self.done / max(seconds, 1e-9) / 1e9:.2f} GB/s)")


def sha256_file(path: Path, size: int, log=print, why: str = "") -> str:
    """The hex sha256 of the file's whole content, read in order (`size`: its size, for the progress)."""
    digest, progress = hashlib.sha256(), _Progress(Path(path), size, log, why, "sha256, sequential")
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            progress.add(len(chunk))
    progress.close()
    return digest.hexdigest()


def _hash_piece(fd: int, buffer: bytearray, offset: int, length: int) -> bytes:
    """The raw sha256 of bytes [offset, offset + length) of `fd`, read READ_BYTES at a time into `buffer`
    (a piece read whole, 64 MiB, leaves the caches before sha256 reads it: 2x slower on one thread of a
    2-core EPYC in an exploratory run); fewer bytes if the file ends first."""
    digest, view, end = hashlib.sha256(), memoryview(buffer), offset + length
    while offset < end:
        n = os.preadv(fd, [view[:min(len(buffer), end - offset)]], offset)
        if n == 0:  # the file shrank since its size was taken: what was read is hashed (and will differ)
            break
        digest.update(view[:n])
        offset += n
    return digest.digest()


def piece_digest(path: Path, size: int, log=print, why: str = "", piece_bytes: int | None = None,
                 threads: int | None = None) -> str:
    """The piece digest of the file (module doc) over its first `size` bytes, pieces of `piece_bytes`
    (default PIECE_BYTES) hashed by `threads` threads (default `hash_threads()`)."""
    piece_bytes = piece_bytes or PIECE_BYTES
    threads = threads or hash_threads()
    offsets = range(0, size, piece_bytes)
    progress = _Progress(Path(path), size, log, why,
                         f"sha256 of {_size_name(piece_bytes)} pieces, {min(threads, len(offsets))} threads")
    local = threading.local()  # each worker's one buffer: memory is threads x READ_BYTES

    def one(offset: int) -> bytes:
        if getattr(local, "buffer", None) is None:
            local.buffer = bytearray(min(READ_BYTES, piece_bytes))
        return _hash_piece(fd, local.buffer, offset, min(piece_bytes, size - offset))

    outer, fd = hashlib.sha256(), os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="piece-sha256")
    try:
        futures = [pool.submit(one, offset) for offset in offsets]
        for offset, future in zip(offsets, futures):  # in file order; progress from this thread only
            outer.update(future.result())
            progress.add(min(piece_bytes, size - offset))
    finally:  # on an error or an interrupt, pieces not yet started are dropped, not hashed
        pool.shutdown(wait=True, cancel_futures=True)
        os.close(fd)
    progress.close()
    return outer.hexdigest()
