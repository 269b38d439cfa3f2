"""A checkpoint's files written by a forked child while the training goes on.

Why a process: a checkpoint of the `gpu` recipe's drafter (the float32 weights and the Muon and AdamW states)
held its H100 run 1.35 s each, 54 times in 20 minutes: 6.4 % of the training minutes (docs/LOG.md, session 29).
A writer thread does not help: serialising, hashing and writing hold the GIL in stretches, and beside a
host-bound training loop the write took 6x as long while the loop ran at 37 % of its speed (the same
measurement, this CPU). A forked child has its own GIL, and fork's copy-on-write pages give it a consistent
snapshot of the host memory for free: the parent copies only its device tensors to the host first
(`host_copy`), forks, and goes on.

What the child may do: write files from host tensors, hash, rename, link, prune, then `os._exit`. It closes
the descriptors it inherited (the run's lock on its directory among them) and never
touches CUDA (a forked child cannot), never prints (another thread of the parent may have held the stream's
lock when it forked), ignores the stop signals (a Ctrl-C of the terminal reaches the whole process group: the
write it was asked for completes, atomically, in about a second) and disables the garbage collector (the
parent's objects are not its to free). Its error comes back through a pipe as text and is raised by the
parent at `wait` (the next checkpoint, the final one, or the interpreter's exit). A wait that lasts says so
every `SAY_EVERY` seconds on stderr (a hung file system holds the next checkpoint or the exit: said, with the
writer's pid, never a silent stall). Linux only; elsewhere, or where fork fails (no memory for the page
tables), the write runs in the caller.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import select
import signal
import sys
import time
import warnings

import torch

_PENDING: set["ForkedWrite"] = set()
SAY_EVERY = 30.0  # seconds between the lines a long wait for a writer prints (a checkpoint takes ~1 s)


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def host_copy(obj):
    """`obj` (tensors in dicts, lists and tuples) with every device tensor copied to the host; host tensors are
    kept as they are (the fork snapshots them)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {key: host_copy(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(value) for value in obj)
    return obj


class ForkedWrite:
    """`write()` run in a forked child; `wait()` returns its error message (None: written)."""

    def __init__(self, write, what: str):
        self.what = what
        read_end, write_end = os.pipe()
        try:
            with warnings.catch_warnings():  # Python warns of fork in a threaded process: the child's work is fork-safe
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:  # the caller writes instead
            os.close(read_end)
            os.close(write_end)
            raise
        if pid == 0:
            _child(write, read_end, write_end)
        os.close(write_end)
        self.pid, self.fd = pid, read_end
        _PENDING.add(self)

    def wait(self, say=None, every: float | None = None) -> str | None:
        """The write to its end; its error message, or None. While it lasts, `say` (default: stderr) hears
        every `every` seconds (default `SAY_EVERY`) what is awaited and for how long."""
        say, every, start = say or _say_on_stderr, every or SAY_EVERY, time.monotonic()
        while not select.select([self.fd], [], [], every)[0]:  # readable: the child's error, or its exit (EOF)
            say(f"checkpoint: still waiting for the writer of {self.what} (pid {self.pid}) after "
                f"{time.monotonic() - start:.0f} s; a Ctrl-C leaves it to finish on its own (it ignores stop "
                f"signals; its files are renamed into place only when whole)")
        with os.fdopen(self.fd, "rb") as pipe:
            message = pipe.read().decode(errors="replace").strip()
        _, status = os.waitpid(self.pid, 0)
        _PENDING.discard(self)
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            return None
        return message or f"the writer of {self.what} (pid {self.pid}) ended with status {code}"


def _say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def settled_on_error(wait, log):
    """Work beside a background write: an error leaving the block first waits for the write in flight (`wait`),
    so a run resumed right after in this process (or a caller that looks) finds that checkpoint whole, not still
    being written; the write's own failure is logged and the error that ended the work is the one raised."""
    try:
        yield
    except BaseException:
        try:
            wait()
        except OSError as e:  # CheckpointWriteError
            log(f"checkpoint: {e}")
        raise


def _child(write, read_end: int, write_end: int) -> None:
    os.close(read_end)
    code = 1
    try:
        # the parent's descriptors are not the child's to hold: the run's flock on train.out_dir (a resumed run
        # must not find it held by a writer that outlived a killed parent), its sockets, the driver's files
        os.closerange(3, write_end)
        os.closerange(write_end + 1, os.sysconf("SC_OPEN_MAX"))
        gc.disable()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        torch.set_num_threads(1)
        write()
        code = 0
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent as text
        os.write(write_end, f"{e}".encode(errors="replace")[:8000])
    finally:
        os._exit(code)


@atexit.register
def _wait_for_pending() -> None:
    """A run that ends by an error while a write is in flight leaves its checkpoint whole, not half-renamed."""
    for pending in list(_PENDING):
        error = pending.wait()
        if error is not None:  # nobody is left to raise it to: said, never dropped
            print(f"checkpoint: {error}", file=sys.stderr, flush=True)
