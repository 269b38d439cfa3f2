"""Hashing a verified cache file: the plain sequential sha256 (what `cache.py` recorded before issue 37,
and still checks where an older record holds it) against the piece digest it records now
(`hashing.piece_digest`: 64 MiB pieces hashed by a thread pool), on one temporary file.

    python bench/hash_throughput.py                  # a 1 GB file, 5 rounds
    python bench/hash_throughput.py --gb 14.6        # the size of the gpu recipe's taps file
    python bench/hash_throughput.py --cold           # each hashing reads the disk (the file's pages dropped first)
    python bench/hash_throughput.py --small          # 64 MB, 4 MiB pieces, 2 rounds (seconds)

The file is written once into --dir (default: the system's temporary directory; random 1 MiB blocks
repeated: sha256's speed does not depend on the bytes), synced, and removed at the end. The two are timed
interleaved, round by round (sequential, then pieces), so drift on a shared machine touches both; each
figure is the median over the rounds. Without --cold the file is in the page cache, as when `cache.py`
records a file it has just written; --cold drops the file's pages before each hashing (posix_fadvise
DONTNEED, allowed to any reader of a synced file), as when a later run checks a cache it has not read.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as C  # noqa: E402
from dflash_train import hashing  # noqa: E402

BLOCK = 1 << 20


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="64 MB, 4 MiB pieces, 2 rounds (seconds)")
    p.add_argument("--gb", type=float, help="file size in GB (default 1; 0.064 with --small)")
    p.add_argument("--rounds", type=int, help="timed rounds of each (default 5; 2 with --small)")
    p.add_argument("--piece-mib", type=int, help=f"piece size (default {hashing.PIECE_BYTES >> 20}; 4 with --small)")
    p.add_argument("--threads", type=int, help=f"pool threads (default {hashing.hash_threads()}: "
                                               f"this machine's CPUs, at most {hashing.MAX_THREADS})")
    p.add_argument("--cold", action="store_true", help="drop the file's cached pages before each hashing")
    p.add_argument("--dir", help="where the temporary file goes (default: the system's temporary directory)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    a.gb = a.gb or (0.064 if a.small else 1.0)
    a.rounds = a.rounds or (2 if a.small else 5)
    a.piece_mib = a.piece_mib or (4 if a.small else hashing.PIECE_BYTES >> 20)
    a.threads = a.threads or hashing.hash_threads()
    return a


def write_file(path: Path, size: int, b: C.Bench) -> None:
    block, t0 = os.urandom(BLOCK), time.perf_counter()
    with open(path, "wb") as f:
        for start in range(0, size, BLOCK):
            f.write(block[:min(BLOCK, size - start)])
        f.flush()
        os.fsync(f.fileno())  # no writeback during the timings, and --cold can drop every page
    b.log(f"wrote {path} ({size / 1e9:.3f} GB) in {time.perf_counter() - t0:.1f} s")


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, path: Path, cold: bool) -> tuple[float, str]:
    if cold:
        drop_pages(path)
    t0 = time.perf_counter()
    digest = fn()
    return time.perf_counter() - t0, digest


def rounds(a, path: Path, size: int, b: C.Bench) -> None:
    piece = a.piece_mib << 20
    quiet = lambda line: None  # noqa: E731 - the bench's own lines say the rate
    runs = {"sequential": lambda: hashing.sha256_file(path, size, quiet),
            "parallel": lambda: hashing.piece_digest(path, size, quiet, piece_bytes=piece, threads=a.threads)}
    seconds, digests = {k: [] for k in runs}, {k: set() for k in runs}
    timed(runs["parallel"], path, False)  # warm-up: page cache filled, the pool's first start paid
    for r in range(a.rounds):
        for kind, fn in runs.items():
            s, digest = timed(fn, path, a.cold)
            seconds[kind].append(s)
            digests[kind].add(digest)
        b.log(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {seconds[k][-1]:.2f} s ({size / seconds[k][-1] / 1e9:.2f} "
                                                        "GB/s)" for k in runs))
    if any(len(d) != 1 for d in digests.values()):
        raise RuntimeError(f"a digest changed between rounds: {digests}")
    if size <= 1 << 28:  # small enough to check both against hashlib over the bytes in memory
        data = path.read_bytes()
        pieces = b"".join(hashlib.sha256(data[i:i + piece]).digest() for i in range(0, size, piece))
        want = {"sequential": hashlib.sha256(data).hexdigest(), "parallel": hashlib.sha256(pieces).hexdigest()}
        if {k: next(iter(d)) for k, d in digests.items()} != want:
            raise RuntimeError(f"digests {digests} are not hashlib's over the bytes in memory {want}")
    for kind in runs:
        median = C.median(seconds[kind])
        b.figure(f"{kind}_s", median, f"median of {a.rounds}")
        b.figure(f"{kind}_gb_s", size / median / 1e9)
        b.figure(f"{kind}_best_gb_s", size / min(seconds[kind]) / 1e9, "the fastest round: on a shared machine, "
                 "the nearest to what it can do")
    b.figure("ratio", b.figures["parallel_gb_s"] / b.figures["sequential_gb_s"], "parallel / sequential GB/s")


def main(argv=None) -> int:
    a = parse(argv)
    b = C.Bench("hash_throughput", a)
    size = int(a.gb * 1e9)
    b.figure("file_gb", size / 1e9)
    b.figure("threads", a.threads, f"of {os.cpu_count()} CPUs")
    b.figure("piece_mib", a.piece_mib)
    b.info.update(cold=a.cold, load_average=os.getloadavg())
    b.log(f"{'cold (pages dropped before each hashing)' if a.cold else 'page cache'}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="hash-throughput-", dir=a.dir) as folder:
        path = Path(folder) / "file.bin"
        with b.phase("write"):
            write_file(path, size, b)
        if b.ok("write"):
            with b.phase("time"):
                rounds(a, path, size, b)
    f = b.figures
    verdict = (f"sequential {f['sequential_gb_s']:.2f} GB/s, parallel {f['parallel_gb_s']:.2f} GB/s ({a.threads} "
               f"threads x {a.piece_mib} MiB), {f['ratio']:.2f}x on {size / 1e9:.3g} GB "
               f"({'cold' if a.cold else 'page cache'})" if "ratio" in f else "no timings")
    return b.finish(verdict, a.json)


if __name__ == "__main__":
    sys.exit(main())
