"""A stall watchdog for every training process, and an on-demand stack dump.

The pipeline this project replaces hung in a compile deadlock and printed nothing (shared/docs/
compile-race.md, section 2). A hung rank must instead say where it is and then die, so that
torchrun (or our parent) tears the whole job down rather than waiting forever on a collective:

    wd = Watchdog(cfg.train.watchdog_seconds, name=f"rank{rank}").start()
    for step in ...:
        wd.beat(f"step {step}")            # cheap: one tuple assignment
        with wd.stage("eval"): evaluate()  # a named stage the dump will point at
    wd.stop()

`install_signal_stack_dump()` lets a user ask a running job where it is: `kill -USR1 <pid>`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Iterator, TextIO


def format_thread_stacks() -> str:
    """Every Python thread's stack, with thread names (faulthandler only shows ids)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    chunks = []
    for ident, frame in sys._current_frames().items():
        label = names.get(ident, "?")
        chunks.append(f"--- thread {label} (ident {ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(chunks)


def _dump_all(out: TextIO) -> None:
    """faulthandler first (works even if a thread is wedged in C), then the named Python stacks."""
    try:
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both of the last two
        pass  # `out` without a real file descriptor (tests' StringIO): the named stacks suffice
    out.write("\n" + format_thread_stacks() + "\n")
    out.flush()


class Watchdog:
    """Fires when no `beat()` arrives for `timeout_s`: prints the last stage and all stacks, then exits.

    `exit_code` is used with `os._exit` (no cleanup: a wedged thread could block a normal exit).
    `on_fire(message)`, if given, replaces the exit (tests, the doctor); the stacks are printed first.
    `explain()`, if set, says what is known about the cause (train: a peer rank that is stopped), added
    to the message.
    """

    def __init__(self, timeout_s: float, name: str = "", exit_code: int = 3, out: TextIO | None = None,
                 on_fire: Callable[[str], None] | None = None):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 s, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.name = name
        self.exit_code = exit_code
        self.out = out  # None = sys.stderr at fire time (follows redirection)
        self.on_fire = on_fire
        self.explain: Callable[[], str] | None = None
        now = time.monotonic()
        self._state = ("started", now, now)  # (stage, entered at, last beat): replaced whole, never mutated
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def start(self) -> "Watchdog":
        """Start the daemon thread (a daemon, so it never keeps a finished process alive)."""
        if self._thread is None:
            self.beat("started")
            self._thread = threading.Thread(target=self._watch, name=f"watchdog-{self.name}", daemon=True)
            self._thread.start()
        return self

    def beat(self, stage: str) -> None:
        """Record progress. The stage's entry time is kept while the same stage keeps beating."""
        now = time.monotonic()
        prev_stage, entered, _ = self._state
        self._state = (stage, entered if stage == prev_stage else now, now)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Record `name` on entry: a stall inside the block is reported as this stage."""
        self.beat(name)
        yield

    def stop(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        """The daemon loop: fire once when the last beat is older than the timeout."""
        # Poll often enough that a fire comes well within the timeout's slack, rarely enough to cost nothing.
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            stage, entered, last = self._state
            idle = time.monotonic() - last
            if idle >= self.timeout_s:
                self._fire(stage, idle, time.monotonic() - entered)
                return

    def _cause(self) -> str:
        try:
            return self.explain() if self.explain is not None else ""
        except Exception as e:  # noqa: BLE001 - a broken explanation must not stop the dump
            return f"(unknown: {type(e).__name__}: {e})"

    def _fire(self, stage: str, idle: float, in_stage: float) -> None:
        """Say where we are (flushed), dump every stack, then exit (or call `on_fire`)."""
        self.fired = True
        out = self.out if self.out is not None else sys.stderr
        message = (f"WATCHDOG[{self.name} pid={os.getpid()}]: no progress for {idle:.1f}s; "
                   f"last stage: '{stage}' (entered {in_stage:.1f}s ago)")
        cause = self._cause()
        if cause:
            message += f"; the cause: {cause}"
        out.write(message + "\n")
        _dump_all(out)
        if self.on_fire is not None:
            self.on_fire(message)
            return
        out.write(f"WATCHDOG[{self.name} pid={os.getpid()}]: exiting with code {self.exit_code}\n")
        out.flush()
        os._exit(self.exit_code)


def install_signal_stack_dump(sig: int | None = None, file: TextIO | None = None) -> bool:
    """On `sig` (default SIGUSR1) print every thread's stack to `file` (default stderr); keep running.

    Returns False where the signal does not exist (Windows). faulthandler writes from its C handler,
    so this answers even when the main thread is stuck in native code holding the GIL. A `file`
    without a descriptor (a captured stream) falls back to the process's own stderr."""
    sig = sig if sig is not None else getattr(signal, "SIGUSR1", None)
    if sig is None or not hasattr(faulthandler, "register"):
        return False
    for out in (file if file is not None else sys.stderr, sys.__stderr__):
        try:
            faulthandler.register(sig, file=out, all_threads=True)
            return True
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation: no fileno
            continue
    return False


def remove_signal_stack_dump(sig: int | None = None) -> None:
    """Undo `install_signal_stack_dump` (the signal's default action again)."""
    sig = sig if sig is not None else getattr(signal, "SIGUSR1", None)
    if sig is not None and hasattr(faulthandler, "unregister"):
        faulthandler.unregister(sig)
