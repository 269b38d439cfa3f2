"""The run's health checks, used by drafter and target ranks alike: the compile-health watch
(after warm-up nothing new may compile and flex attention must run compiled, rule 1 of the house),
the stop flag of SIGTERM/SIGINT, and the fault injection that tests failure handling."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from dflash_train.diagnostics import compile_health as ch

FAULT_ENV = "DFLASH_INJECT_FAULT"  # "raise|hang:rank=R:step=S", for testing failure handling


@dataclass(frozen=True)
class FaultPlan:
    """A fault to inject, parsed once from FAULT_ENV at start-up: raise, or stall forever, on
    rank R after step S. `FaultPlan.from_env()` without the variable injects nothing."""

    kind: str = ""
    rank: int = -1
    step: int = -1
    spec: str = ""

    @classmethod
    def from_env(cls) -> "FaultPlan":
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return cls()
        kind, *fields = spec.split(":")
        if kind not in ("raise", "hang"):
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected raise|hang:rank=R:step=S")
        where = dict(f.split("=") for f in fields)
        return cls(kind, int(where.get("rank", -1)), int(where.get("step", -1)), spec)

    def inject_fault(self, rank: int, step: int) -> None:
        if not self.kind or (rank, step) != (self.rank, self.step):
            return
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault ({FAULT_ENV}={self.spec})")


class StopFlag:
    """SIGTERM/SIGINT: inside the training loop (`deferring`), the loop checkpoints and stops at the
    next step boundary; anywhere else, or on a second signal, the process stops at once."""

    def __init__(self):
        self.signal = None
        self.deferring = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.deferring or self.signal is not None:
            print(f"{name}: stopping now", flush=True)
            raise SystemExit(128 + signum)
        self.signal = name
        print(f"{name}: will checkpoint and stop after this step (again to stop at once)", flush=True)

    def __call__(self) -> bool:
        return self.signal is not None

HEALTH_WARMUP_STEPS, HEALTH_CHECK_STEPS = 2, 2  # compile during the first, verify over the next


class CompileHealthWatch:
    """After warm-up, verify that no step compiles anything new and that flex attention runs
    compiled (no eager fallback); then forbid recompiles for the rest of the run. Fails loudly."""

    def __init__(self, enabled: bool, expect_flex: bool, start_step: int, log):
        self.enabled, self.expect_flex, self.log = enabled, expect_flex, log
        self.before = None
        self.warm_at = start_step + HEALTH_WARMUP_STEPS
        self.check_at = self.warm_at + HEALTH_CHECK_STEPS
        if enabled:
            ch.track_eager_flex_calls()

    def after_step(self, step: int, last: bool) -> None:
        if not self.enabled:
            return
        if step == self.warm_at:
            self.before = ch.CompileCounters.snapshot()
        elif self.before is not None and (step == self.check_at or last):
            report = ch.assert_compile_healthy(self.before, ch.CompileCounters.snapshot(),
                                               expect_compiled_flex=self.expect_flex)
            frozen = ch.freeze_compilation()
            self.log(f"compile health: OK after warm-up ({report.summary()}); recompiles "
                     f"{'now forbidden' if frozen else 'not forbidden (no set_stance in this torch)'}")
            self.before = None
