"""Caches shared by processes: real processes race on an empty directory (one build, all see it
whole), a SIGKILLed builder leaves nothing a reader trusts, waiters say whom they wait for."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import signal
import time
from pathlib import Path

import pytest

from dflash_train import cache, hashing

RACERS = 8
PAYLOAD = "complete payload\n"


def _fill(tmp: Path, builds_log: Path, pause_s: float) -> None:
    """A slow build that records itself (O_APPEND: one line per build, whoever runs it)."""
    with open(builds_log, "a") as f:
        f.write(f"{os.getpid()}\n")
    (tmp / "sub").mkdir()
    (tmp / "sub" / "part.bin").write_bytes(b"x" * 1000)
    time.sleep(pause_s)  # the window in which the other racers arrive
    (tmp / "data.txt").write_text(PAYLOAD)


def _racer(final: str, builds_log: str, results: str, barrier) -> None:
    lines = []
    barrier.wait()
    built = cache.build_once(Path(final), lambda tmp: _fill(tmp, Path(builds_log), 1.0), "the test cache",
                             log=lines.append)
    content = (Path(final) / "data.txt").read_text()  # read right away, as a rank would
    Path(results, f"{os.getpid()}.json").write_text(json.dumps({"built": built, "content": content, "log": lines}))


def _killed_builder(final: str, builds_log: str, ready: str) -> None:
    def build(tmp: Path) -> None:
        _fill(tmp, Path(builds_log), 0.0)
        Path(ready).touch()
        time.sleep(600)  # SIGKILLed here, mid-build

    cache.build_once(Path(final), build, "the test cache", log=lambda _: None)


def _hold(lock: str, ready: str, seconds: float) -> None:
    with cache.exclusive(Path(lock), "the held thing", log=lambda _: None):
        Path(ready).touch()
        time.sleep(seconds)


def _start(target, *args) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    return proc


def _wait_for(path: Path, proc: mp.Process) -> None:
    while not path.exists():
        assert proc.is_alive(), f"helper process died with exit code {proc.exitcode}"
        time.sleep(0.05)


def test_racing_processes_build_once_and_all_read_it_whole(tmp_path):
    final, builds_log, results = tmp_path / "cache" / "thing", tmp_path / "builds.log", tmp_path / "results"
    results.mkdir()
    barrier = mp.get_context("spawn").Barrier(RACERS)
    procs = [_start(_racer, str(final), str(builds_log), str(results), barrier) for _ in range(RACERS)]
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    outcomes = [json.loads(p.read_text()) for p in results.iterdir()]
    assert len(outcomes) == RACERS
    assert len(builds_log.read_text().splitlines()) == 1
    assert sum(o["built"] for o in outcomes) == 1
    assert all(o["content"] == PAYLOAD for o in outcomes)
    builder_pid = builds_log.read_text().strip()
    waiting = [line for o in outcomes for line in o["log"] if line.startswith("cache: waiting for the test cache")]
    # Each racer takes the lock in turn after the builder (to find the cache complete) and writes its pid there, so
    # a slow waiter may name a later racer; "?" is a holder caught between its lock and its pid write (`_holder`).
    racers = {builder_pid} | {p.stem for p in results.iterdir()}
    named = [re.search(r" being built by pid ([^@,]+)", line).group(1) for line in waiting]
    assert all(pid in racers | {"?"} for pid in named), waiting
    assert builder_pid in named, waiting  # the builder holds it for a second while the others arrive
    marker = json.loads((final / cache.MARKER).read_text())
    assert marker["pid"] == int(builder_pid)
    assert marker["files"] == {"data.txt": len(PAYLOAD), "sub/part.bin": 1000}
    assert sorted(p.name for p in final.parent.iterdir()) == [".thing.lock", "thing"]  # no temporaries left


def test_killed_builder_leaves_nothing_trusted_and_the_next_caller_rebuilds(tmp_path):
    final, builds_log, ready = tmp_path / "thing", tmp_path / "builds.log", tmp_path / "ready"
    proc = _start(_killed_builder, str(final), str(builds_log), str(ready))
    _wait_for(ready, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL
    assert not final.exists() and not cache.is_complete(final)
    leftovers = list(tmp_path.glob(".thing.tmp-*"))
    assert len(leftovers) == 1  # the killed build's temporary, never renamed into place

    lines = []  # the dead builder's lock is free: no wait
    assert cache.build_once(final, lambda tmp: _fill(tmp, builds_log, 0.0), "the test cache", log=lines.append)
    assert any(f"removing {leftovers[0].name}, left by an interrupted build" in line for line in lines)
    assert not any("waiting" in line for line in lines)
    assert cache.is_complete(final) and (final / "data.txt").read_text() == PAYLOAD
    assert not list(tmp_path.glob(".thing.tmp-*"))
    assert len(builds_log.read_text().splitlines()) == 2


def test_waiter_names_the_builder_pid_while_it_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "PROGRESS_EVERY_S", 0.2)
    lock, ready = tmp_path / ".thing.lock", tmp_path / "ready"
    proc = _start(_hold, str(lock), str(ready), 1.5)
    _wait_for(ready, proc)
    lines = []
    with cache.exclusive(lock, "the held thing", log=lines.append):
        pass
    proc.join(timeout=60)
    assert len(lines) >= 3  # at once, then every 0.2 s of a ~1.5 s wait
    assert all(line.startswith(f"cache: waiting for the held thing being built by pid {proc.pid}@") for line in lines)


def test_unmarked_directory_is_rebuilt_unless_vouched_for(tmp_path):
    final, builds_log = tmp_path / "thing", tmp_path / "builds.log"
    final.mkdir()
    (final / "data.txt").write_text("half")  # an older version's directory, or a torn copy
    lines = []
    assert cache.build_once(final, lambda tmp: _fill(tmp, builds_log, 0.0), "the test cache", log=lines.append)
    assert any("removing incomplete the test cache" in line for line in lines)
    assert (final / "data.txt").read_text() == PAYLOAD

    adopted = tmp_path / "old"
    adopted.mkdir()
    (adopted / "data.txt").write_text(PAYLOAD)
    assert not cache.build_once(adopted, lambda tmp: pytest.fail("must not rebuild"), "the old cache",
                                accept_unmarked=lambda d: (d / "data.txt").is_file(), log=lines.append)
    assert cache.is_complete(adopted)
    assert json.loads((adopted / cache.MARKER).read_text())["note"].startswith("adopted")


def test_marker_checks_file_sizes(tmp_path):
    final, builds_log = tmp_path / "thing", tmp_path / "builds.log"
    cache.build_once(final, lambda tmp: _fill(tmp, builds_log, 0.0), "the test cache", log=lambda _: None)
    assert cache.is_complete(final)
    (final / "sub" / "part.bin").write_bytes(b"x" * 10)  # truncated after the fact
    assert not cache.is_complete(final)
    assert cache.build_once(final, lambda tmp: _fill(tmp, builds_log, 0.0), "the test cache", log=lambda _: None)
    assert (final / "sub" / "part.bin").stat().st_size == 1000


def test_single_file_appears_whole_and_once(tmp_path):
    final = tmp_path / "samples.jsonl"
    (tmp_path / ".samples.jsonl.tmp-dead").write_text("torn")  # a SIGKILLed writer's temporary
    lines = []
    assert cache.build_once(final, lambda tmp: tmp.write_text(PAYLOAD), "samples", directory=False, log=lines.append)
    assert not cache.build_once(final, lambda tmp: pytest.fail("must not rebuild"), "samples", directory=False)
    assert final.read_text() == PAYLOAD
    assert any("removing .samples.jsonl.tmp-dead" in line for line in lines)
    assert not (tmp_path / ".samples.jsonl.tmp-dead").exists()


PIECE = 4096


def _piece_reference(data: bytes) -> str:
    """The piece digest written out: sha256 of each PIECE slice, then sha256 of those digests in order."""
    return hashlib.sha256(b"".join(hashlib.sha256(data[i:i + PIECE]).digest()
                                   for i in range(0, len(data), PIECE))).hexdigest()


def _verified(final: Path, data: bytes, lines: list) -> bool:
    return cache.build_once(final, lambda tmp: tmp.write_bytes(data), "the test taps", directory=False,
                            log=lines.append, verify=True)


def test_a_verified_cache_records_its_piece_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "PIECE_BYTES", PIECE)
    final, data = tmp_path / "taps.bin", os.urandom(3 * PIECE + 100)
    assert _verified(final, data, [])
    record = json.loads(cache.record_path_of(final).read_text())
    assert set(record) == {"size", "sha256_pieces_4KiB", "pid", "host", "built"}  # no plain "sha256": not hashed twice
    assert record["size"] == len(data) and record["sha256_pieces_4KiB"] == _piece_reference(data)
    monkeypatch.setattr(hashing, "PIECE_BYTES", 64 << 20)  # checked with the record's piece size, not today's
    assert cache.content_problem(final) == ""
    assert not cache.build_once(final, lambda tmp: pytest.fail("must not rebuild"), "the test taps",
                                directory=False, verify=True)


@pytest.mark.parametrize("kind", ["pieces", "older version's sha256"])
def test_a_changed_byte_in_any_piece_is_caught_for_both_record_kinds(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(hashing, "PIECE_BYTES", PIECE)
    final, data = tmp_path / "taps.bin", os.urandom(3 * PIECE + 100)
    _verified(final, data, [])
    if kind != "pieces":  # the record an older version wrote: the plain sha256
        cache.record_path_of(final).write_text(json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                                           "pid": 1, "host": "h", "built": "2026-12-04T10:00:00"}))
    assert cache.content_problem(final) == ""
    assert not cache.build_once(final, lambda tmp: pytest.fail("must not rebuild"), "the test taps",
                                directory=False, verify=True)  # a cache built before this change stays valid
    for where in [0, PIECE - 1, PIECE, 2 * PIECE + 17, len(data) - 1]:  # every piece, its edges, the short last
        changed = bytearray(data)
        changed[where] ^= 0x01
        final.write_bytes(changed)
        problem = cache.content_problem(final)
        assert "sha256 differs" in problem and ("piecewise" in problem) == (kind == "pieces"), (where, problem)
    lines = []
    assert _verified(final, data, lines)  # named and rebuilt, with a record of the new kind
    assert any("not what was built; removing it and rebuilding" in line for line in lines)
    assert final.read_bytes() == data
    assert json.loads(cache.record_path_of(final).read_text())["sha256_pieces_4KiB"] == _piece_reference(data)


def test_file_sha256_stays_the_plain_sha256(tmp_path, monkeypatch):
    """A target's identity (exports record it) is the plain sha256, whatever the verified caches use."""
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hashing, "PIECE_BYTES", PIECE)
    path, data = tmp_path / "weights.bin", os.urandom(3 * PIECE + 100)
    path.write_bytes(data)
    assert cache.file_sha256(path, log=pytest.fail) == hashlib.sha256(data).hexdigest()


def test_second_prepare_into_a_busy_shard_directory_is_refused(tmp_path):
    # Local import: the spawned helpers import this module, and they need no torch.
    from dflash_train.data.shards import LOCK_NAME, prepare_shards

    out, ready = tmp_path / "shards", tmp_path / "ready"
    proc = _start(_hold, str(out / LOCK_NAME), str(ready), 60)
    try:
        _wait_for(ready, proc)
        with pytest.raises(cache.CacheBusy, match=f"shard directory {out} is being written by pid {proc.pid}@"):
            prepare_shards(None, [], out, [0], "bf16")  # refused before it reads anything
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    finally:
        proc.kill()
        proc.join(timeout=60)


def test_a_home_that_cannot_be_written_gives_one_clear_message(tmp_path):
    """Issue 39: a read-only HOME gave three chained tracebacks. A HOME that is a file cannot hold a
    cache for any user (root included): one FAILED line naming the directory and DFLASH_TRAIN_CACHE."""
    import subprocess
    import sys

    home = tmp_path / "home"
    home.write_text("not a directory")
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_TRAIN_CACHE"}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-m", "dflash_train", "train", "--recipe", "tiny",
                           f"train.out_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("dflash-train train: FAILED:") and f"{home}/.cache/dflash-train" in last
    assert "DFLASH_TRAIN_CACHE" in last


def test_a_verified_file_is_renamed_without_waiting_for_the_disk(tmp_path, monkeypatch):
    """A verified cache is hashed on every use, so its build skips the fsyncs (15.5 GB of taps waited on the disk);
    an unverified file still waits for them, and both land whole under their final name."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    for verify in (True, False):
        synced.clear()
        final = tmp_path / f"f{verify}.bin"
        assert cache.build_once(final, lambda tmp: Path(tmp).write_bytes(b"x" * 1000), "a file", directory=False,
                                verify=verify, log=lambda line: None)
        data_synced = [p for p in synced if final.name in p and "sha256" not in p]  # the record stays durable
        assert final.read_bytes() == b"x" * 1000 and bool(data_synced) != verify
    assert not cache.content_problem(tmp_path / "fTrue.bin", log=lambda line: None)
