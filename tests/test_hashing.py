"""The piece digest against a reference written here (hashlib over the file's slices, then sha256 of the
digests concatenated), at the sizes where the cutting can go wrong; its record key; its progress lines,
said by the calling thread only. Small pieces through the parameter keep the files small."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from dflash_train import hashing

PIECE = 4096
SIZES = [0, 1, PIECE - 1, PIECE, PIECE + 1, 5 * PIECE + 7]


def reference(data: bytes, piece: int) -> str:
    slices = [data[i:i + piece] for i in range(0, len(data), piece)]
    return hashlib.sha256(b"".join(hashlib.sha256(s).digest() for s in slices)).hexdigest()


@pytest.mark.parametrize("threads,read_bytes", [(1, None), (3, 1000)])  # 1000: a piece read in uneven parts
@pytest.mark.parametrize("size", SIZES)
def test_piece_digest_is_sha256_over_the_pieces_sha256s(tmp_path, monkeypatch, size, threads, read_bytes):
    if read_bytes:
        monkeypatch.setattr(hashing, "READ_BYTES", read_bytes)
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    got = hashing.piece_digest(path, size, log=pytest.fail, piece_bytes=PIECE, threads=threads)
    assert got == reference(data, PIECE)
    assert hashing.sha256_file(path, size, log=pytest.fail) == hashlib.sha256(data).hexdigest()


def test_an_empty_file_is_sha256_of_nothing_and_pieces_differ_from_the_plain_digest(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    assert hashing.piece_digest(path, 0, piece_bytes=PIECE) == hashlib.sha256(b"").hexdigest()
    data = os.urandom(3 * PIECE)
    path.write_bytes(data)
    assert hashing.piece_digest(path, len(data), piece_bytes=PIECE) != hashlib.sha256(data).hexdigest()
    # the piece size is part of the digest: the record's key must name it
    assert hashing.piece_digest(path, len(data), piece_bytes=PIECE) != hashing.piece_digest(
        path, len(data), piece_bytes=2 * PIECE)


def test_record_key_names_the_scheme_and_piece_size():
    assert hashing.piece_key(64 << 20) == "sha256_pieces_64MiB"
    for piece in (64 << 20, PIECE, 1000, 1):
        assert hashing.piece_size_of(hashing.piece_key(piece)) == piece
    assert hashing.piece_size_of("sha256") is None and hashing.piece_size_of("sha256_pieces_64MiBx") is None
    assert 1 <= hashing.hash_threads() <= hashing.MAX_THREADS


def test_large_files_say_what_they_hash_with_rate_and_eta_from_the_calling_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "ANNOUNCE_BYTES", 1)  # every file counts as large
    monkeypatch.setattr(hashing, "PROGRESS_EVERY_S", 0.0)  # a progress line per piece
    data = os.urandom(6 * PIECE)
    path = tmp_path / "taps.bin"
    path.write_bytes(data)
    lines, callers = [], set()

    def log(line: str) -> None:
        lines.append(line)
        callers.add(threading.get_ident())

    hashing.piece_digest(path, len(data), log, "to check it", piece_bytes=PIECE, threads=3)
    assert callers == {threading.get_ident()}
    assert lines[0].startswith(f"hashing {path} (") and "4 KiB pieces, 3 threads) to check it" in lines[0]
    progress = [line for line in lines if line.startswith("hashing taps.bin: ")]
    assert len(progress) == 6 and all(" GB/s, ETA " in line for line in progress)
    assert progress[-1].startswith("hashing taps.bin: 100% of")
    assert lines[-1].startswith("hashed taps.bin: ")
    lines.clear()
    hashing.sha256_file(path, len(data), log, "once")
    assert lines[0].endswith("sha256, sequential) once") and lines[-1].startswith("hashed taps.bin: ")
