"""The run's health checks, used by drafter and target ranks alike: the compile-health watch
(after warm-up nothing new may compile and flex attention must run compiled, rule 1 of the house),
the non-finite guard's bookkeeping (`BadStepGuard`; the skip itself happens on the device,
`step.health_flags` and `optim.step_unless`), and the fault injection that tests failure handling.
Stopping (signals, the launcher's death, ranks that end early) is train/watch/stop.py."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from dflash_train.diagnostics import compile_health as ch

FAULT_ENV = "DFLASH_INJECT_FAULT"  # "KIND:rank=R:step=S[:count=N]", for testing failure handling
FAULT_KINDS = ("raise", "hang", "nan", "skip", "prewarm")


@dataclass(frozen=True)
class FaultPlan:
    """A fault to inject, parsed once from FAULT_ENV at start-up, at step S (`count` steps from S
    for nan and skip):
      raise  rank R raises after step S        hang  rank R stalls forever after step S
      nan    rank R's first micro-batch of the step gets a NaN in its taps: a drafter rank's as
             it trains on it, a target rank's before it sends them (the guard, both ways)
      skip   every drafter rank leaves the step's update out on the host (the guard's reference)
      prewarm  rank R's compile prewarm gets taps one column too wide: it fails in its first forward and
             the run goes on without it (train/prewarm; the step S is not read)
    `FaultPlan.from_env()` without the variable injects nothing."""

    kind: str = ""
    rank: int = -1
    step: int = -1
    count: int = 1
    spec: str = ""

    @classmethod
    def from_env(cls) -> "FaultPlan":
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return cls()
        kind, *fields = spec.split(":")
        try:
            where = {k: int(v) for k, v in (f.split("=") for f in fields)}
        except ValueError:
            where = None
        if kind not in FAULT_KINDS or where is None or not set(where) <= {"rank", "step", "count"}:
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected {'|'.join(FAULT_KINDS)}:rank=R:step=S[:count=N]")
        return cls(kind, where.get("rank", -1), where.get("step", -1), where.get("count", 1), spec)

    def _hits(self, kind: str, step: int) -> bool:
        return self.kind == kind and self.step <= step < self.step + self.count

    def inject_fault(self, rank: int, step: int) -> None:
        if self.kind not in ("raise", "hang") or (rank, step) != (self.rank, self.step):
            return
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault ({FAULT_ENV}={self.spec})")

    def poisons(self, rank: int, step: int) -> bool:
        """nan: whether `rank` puts a NaN in its first micro-batch of `step` (1-based)."""
        return rank == self.rank and self._hits("nan", step)

    def corrupt_taps(self, rank: int, step: int, mbs: list) -> None:
        """nan on a drafter rank: one NaN in the taps of its first micro-batch of `step`."""
        if self.poisons(rank, step) and mbs:
            mbs[0].from_target["taps"].view(-1)[0] = float("nan")

    def prewarm_fault(self, rank: int) -> bool:
        """prewarm: whether `rank`'s compile prewarm is given a bad shape."""
        return self.kind == "prewarm" and rank == self.rank

    def skips(self, step: int) -> bool:
        """skip: the update of `step` is left out, on every drafter rank."""
        return self._hits("skip", step)


class NonFiniteSteps(RuntimeError):
    """`train.max_bad_steps` consecutive steps were not finite: the run stops with this cause."""


class BadStepGuard:
    """Counts and reports the steps the non-finite guard skipped (`step.health_flags`). Stateful.

    The flags stay on the device until `check` (called where the loop reads its figures anyway:
    logging, checkpoints, the end), so watching costs no host sync per step. Each rank names its
    own bad micro-batches (rank, step, sample ids); `check` raises NonFiniteSteps once
    `max_consecutive` steps in a row were skipped, before any checkpoint is written after them."""

    def __init__(self, rank: int, max_consecutive: int, log):
        self.rank, self.max_consecutive, self.log = rank, max_consecutive, log
        self.pending: list[tuple[int, list[list[str]], torch.Tensor]] = []  # (step, ids per micro-batch, flags)
        self.total, self.streak = 0, 0

    def record(self, step: int, mbs: list, flags) -> None:
        self.pending.append((step, [list(mb.ids) for mb in mbs], flags))

    def check(self) -> int:
        """Read the pending flags (one device-to-host copy); log and count; the skipped steps since
        the last check."""
        if not self.pending:
            return 0
        values = torch.stack([flags for _, _, flags in self.pending]).cpu().tolist()
        skipped = 0
        for (step, ids, _), row in zip(self.pending, values):
            if not row[0]:
                self.streak = 0
                continue
            skipped, self.total, self.streak = skipped + 1, self.total + 1, self.streak + 1
            bad = [f"micro-batch {m} samples {ids[m]}" for m, flag in enumerate(row[1:]) if flag]
            where = "; ".join(bad) if bad else "a finite loss here: another rank's, or the gradient norm"
            self.log(f"step {step}: non-finite loss or gradient norm, update skipped (rank {self.rank}: {where}); "
                     f"{self.streak} in a row, {self.total} in all (train.max_bad_steps={self.max_consecutive})")
        self.pending.clear()
        if self.streak >= self.max_consecutive:
            raise NonFiniteSteps(f"{self.streak} consecutive non-finite steps (train.max_bad_steps="
                                 f"{self.max_consecutive}): stopping; the last checkpoint holds the last good weights")
        return skipped

    def state_dict(self) -> dict:
        return {"total": self.total, "streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.streak = state["total"], state["streak"]


HEALTH_WARMUP_STEPS, HEALTH_CHECK_STEPS = 2, 2  # compile during the first, verify over the next


class CompileHealthWatch:
    """After warm-up, verify that no step compiles anything new and that flex attention runs
    compiled (no eager fallback); then forbid recompiles for the rest of the run. Fails loudly."""

    def __init__(self, enabled: bool, expect_flex: bool, start_step: int, log, expect_graphs: bool = False):
        self.enabled, self.expect_flex, self.log = enabled, expect_flex, log
        self.expect_graphs = expect_graphs  # train.compile_mode=reduce-overhead: no step may run outside its graphs
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
                                               expect_compiled_flex=self.expect_flex, expect_graphs=self.expect_graphs)
            frozen = ch.freeze_compilation()
            self.log(f"compile health: OK after warm-up ({report.summary()}); recompiles "
                     f"{'now forbidden' if frozen else 'not forbidden (no set_stance in this torch)'}")
            self.before = None
