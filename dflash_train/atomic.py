"""Atomic files and directories: write into a temporary sibling, fsync, rename into place.

A reader (or a resumed job) therefore sees either the old complete version or the new complete
version, never a torn one, whatever kills the writer. A directory is only ever replaced when its
writer vouches for what is there (`atomic_dir(replaceable=)`): a user's file or directory at the
path is refused, never moved or deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


def _sibling(path: Path, kind: str = "tmp") -> Path:
    """A fresh hidden name beside `path`. Named before it is created, so a signal that interrupts the
    creation (cli.py raises from its SIGTERM handler between any two bytecodes) leaves a name the
    cleanup knows: `tempfile.mkstemp` returns its name only after creating the file."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{os.urandom(4).hex()}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_with(path: str | Path, write, durable: bool = True) -> None:
    """Atomic version of `write(tmp_path)` for writers that want a path (safetensors, torch.save). `durable=False`
    renames without waiting for the disk: only for a file whose content is checked on every use (a verified
    cache, `cache.build_once`), which a crash that left it short gets rebuilt instead of read."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


class DestinationInUse(FileExistsError):
    """The path to write exists and is not something the writer may replace: nothing was written."""

    readable = True  # cli.py: the message alone, no traceback


def _check_destination(final: Path, replaceable, what: str) -> None:
    """`final` may be written when it does not exist, is an empty directory, or is a directory
    `replaceable(final)` vouches for; anything else (a file, a link, someone's directory) is refused
    before anything is written, and never moved or deleted."""
    if not (final.exists() or final.is_symlink()):
        return
    if final.is_dir() and not final.is_symlink():
        if not any(final.iterdir()) or (replaceable is not None and replaceable(final)):
            return
    kind = "a link" if final.is_symlink() else "a directory" if final.is_dir() else "a file"
    raise DestinationInUse(f"{final} exists and is {kind} that is not {what}: nothing was written and nothing of "
                           "it was moved or deleted; choose another path, or remove it yourself")


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place. An existing `final` (one the caller may replace:
    `atomic_dir` checked) is renamed to a hidden sibling first and removed once the new one is there."""
    old = None
    if final.exists():
        old = _sibling(final, "old")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | Path, replaceable=None, what: str = "a directory this program wrote"):
    """Yield a temporary sibling directory; on success it is fsynced and renamed to `final`.

    `final` must not exist, be an empty directory, or be a directory `replaceable(final)` vouches
    for (checked before the block and again before the swap); otherwise `DestinationInUse` is raised
    and `final` is left as it is. On any exception (a signal included: cli.py turns SIGTERM into
    one) the temporary directory is removed and `final` is untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _check_destination(final, replaceable, what)
    tmp = _sibling(final)
    try:
        tmp.mkdir()
        yield tmp
        _fsync_tree(tmp)
        _check_destination(final, replaceable, what)  # it may have appeared meanwhile
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def point_link(link: str | Path, target_name: str) -> None:
    """Atomically (re)point a relative symlink `link` -> `target_name` (e.g. latest -> step_00000100)."""
    link = Path(link)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target_name, tmp)
    os.replace(tmp, link)
