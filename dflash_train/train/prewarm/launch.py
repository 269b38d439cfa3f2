"""The run's side of the compile prewarm (train.compile_prewarm): start it, wait for it before the first step, say
what it did and what the first step found.

Why: on a machine whose inductor and Triton caches are empty, the `gpu` recipe's first step spent 67 s compiling
(12 s with the caches warm), inside its 3.5-minute training budget, while the ~80 s before it (GGUF conversion,
target load, synthesis, regeneration with taps) was GPU work. On a fresh H100 with the prewarm the first step took
9.3 s (every graph from the cache) and the budget trained 14 % more steps, but regeneration beside it ran at 40 % of
its speed: the data phase took ~44 s longer (docs/PERF.md section 7, session 23; hence worker.NICENESS).

How: right after the config and topology are checked, before the target loads, each drafter rank that will compile
starts `python -m dflash_train.train.prewarm.worker` on its own device: a process, never a thread (rule 1 of the
house: ../shared/docs/compile-race.md, compiling in threads races on process-global flags). The worker builds a
drafter of the run's config with random weights through the loop's own builders and runs the step on dummy
batches cut as the run cuts them (worker.py), which fills inductor's on-disk caches (this process's
TORCHINDUCTOR_CACHE_DIR, inherited), and exits. The first step waits for it (compiling the same graphs at the same
time would only contend; the wait counts in the time budget, as the compile it replaces did), then looks its graphs
up instead of compiling them; `FirstStep` says how many it found.

One per drafter rank, not per node: inductor's FX-graph cache key holds the inputs' device index
(torch/_inductor/codecache.py), so a graph compiled on cuda:0 is a miss on cuda:1. It is only an optimisation: a
prewarm that fails, crashes or outlasts PREWARM_LIMIT_S is said in one line, and the step compiles as it always did;
the training does not depend on it (tests/train/prewarm/).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.config import RunConfig
from dflash_train.diagnostics.compile_health import CompileSeconds, GraphCacheCounts
from dflash_train.train.optim.optimizer import keeps_float32_masters
from dflash_train.train.parallel.parallelize import resolve_compile

WORKER = "dflash_train.train.prewarm.worker"
PREWARM_LIMIT_S = 600.0  # from its start: ten times the gpu recipe's cold compile (~55 s on an H100); then stopped
SAY_EVERY_S = 15.0  # while the first step waits: one progress line this often
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class PrewarmRequest:
    """What the worker is told, pickled onto its stdin: the run's resolved config, this rank's device and the
    number of drafter ranks (the micro-batches per rank, `setup.batch_plan`), and where to write its result."""

    cfg: RunConfig
    device: str
    num_drafters: int
    result_path: str
    launched_at: float  # time.time() when the run started it: its result counts its whole life, imports included
    bad_shape: bool = False  # FaultPlan "prewarm" (tests): taps one column too wide, so the worker fails


def prewarm_plan(cfg: RunConfig, topo, device: torch.device) -> tuple[bool, str]:
    """(start a prewarm here?, why not; "" where there is nothing to say: a target rank, an uncompiled step)."""
    if topo.is_target or not resolve_compile(cfg.train.compile, device):
        return False, ""
    setting = cfg.train.compile_prewarm
    if setting == "off":
        return False, "off (train.compile_prewarm=off)"
    if setting == "auto" and device.type != "cuda":
        return False, ("off (train.compile_prewarm=auto prewarms compiled CUDA runs: on a CPU the data phase uses "
                       "the cores; train.compile_prewarm=on to prewarm here)")
    if topo.num_drafters > 1 and not keeps_float32_masters(cfg.optim, device):
        return False, (f"off: the drafter is DDP-wrapped over {topo.num_drafters} ranks here (float32 parameters), "
                       "whose compiled graphs a one-process prewarm cannot build")
    return True, ""


def start_prewarm(cfg: RunConfig, topo, device: torch.device, out_dir: Path, faults, log) -> "Prewarm | None":
    """This rank's compile prewarm, started now (None, said in one line where useful, when it starts none)."""
    start, why = prewarm_plan(cfg, topo, device)
    if not start:
        if why:
            log(f"compile prewarm: {why}")
        return None
    name = f"compile-prewarm.rank{topo.rank}" if topo.distributed else "compile-prewarm"
    result = Path(out_dir) / f"{name}.json"
    request = PrewarmRequest(cfg, str(device), topo.num_drafters, str(result), time.time(),
                             faults.prewarm_fault(topo.rank))
    try:
        prewarm = Prewarm.launch([sys.executable, "-m", WORKER], pickle.dumps(request), Path(out_dir) / f"{name}.log",
                                 result, PREWARM_LIMIT_S, log)
    except OSError as e:
        log(f"compile prewarm: could not start ({e}); the first step compiles as before")
        return None
    log(f"compile prewarm: compiling the training step in process {prewarm.proc.pid} on {device} while the target "
        f"loads and the data is built (its log: {prewarm.log_path})")
    return prewarm


def _child_env() -> dict:
    """This process's environment (the same inductor and Triton cache directories) without torchrun's rank
    variables: the prewarm is no rank of the job."""
    return {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES and not k.startswith("TORCHELASTIC_")}


class Prewarm:
    """A running compile prewarm: its process (in a session of its own, so that stopping it also stops inductor's
    compile workers), its log and result files, and its time limit."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, result_path: Path, limit_s: float, log):
        self.proc, self.log_path, self.result_path = proc, Path(log_path), Path(result_path)
        self.limit_s, self.log = limit_s, log
        self.started = time.monotonic()
        self.said = False  # its outcome line is printed once

    @classmethod
    def launch(cls, command: list[str], request: bytes, log_path: Path, result_path: Path, limit_s: float,
               log) -> "Prewarm":
        """Start `command` with `request` on its stdin and its output in `log_path`."""
        Path(result_path).unlink(missing_ok=True)  # an earlier run's result must not be read as this one's
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                    env=_child_env(), start_new_session=True)
        try:
            proc.stdin.write(request)
            proc.stdin.close()
        except BrokenPipeError:  # it died at once: its exit status and log say why (`finish`)
            pass
        return cls(proc, log_path, result_path, limit_s, log)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def finish(self, heartbeat=None) -> float:
        """Wait for the prewarm to end, stopping it once it has run PREWARM_LIMIT_S; say how it ended, in one line.
        Returns the seconds waited."""
        t0 = said = time.monotonic()
        while self.proc.poll() is None:
            if self.elapsed() > self.limit_s:
                self.stop()
                self._say(f"compile prewarm: still running after {self.limit_s:g} s: stopped; the first step "
                          f"compiles as before (its log: {self.log_path})")
                return time.monotonic() - t0
            if heartbeat is not None:
                heartbeat("waiting for the compile prewarm")
            if time.monotonic() - said >= SAY_EVERY_S:
                said = time.monotonic()
                self.log(f"compile prewarm: still compiling ({self.elapsed():.0f} s since it started); the first step "
                         "waits for it")
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        self._say(self.outcome())
        return time.monotonic() - t0

    def outcome(self) -> str:
        """One line on how the ended prewarm went: what it compiled, or why it failed."""
        code = self.proc.returncode
        if code == 0 and self.result_path.is_file():
            result = json.loads(self.result_path.read_text())
            graphs = GraphCacheCounts(**result["graphs"])
            start = result["seconds"] - result["build_s"] - result["steps_s"]
            return (f"compile prewarm: done in {result['seconds']:.1f} s ({start:.1f} s starting Python and torch, "
                    f"{result['build_s']:.1f} s building the drafter, {result['steps_s']:.1f} s for {result['steps']} "
                    f"steps): {graphs.fx_misses} graphs compiled into inductor's cache, {graphs.fx_hits} were there "
                    "already")
        how = f"exit {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
        return (f"compile prewarm: FAILED ({how}) after {self.elapsed():.1f} s: {self.last_line()}; the first step "
                f"compiles as before (its log: {self.log_path})")

    def last_line(self) -> str:
        """The last line of its log: for a failure, the exception the worker names there last (worker.FAILED)."""
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return lines[-1].strip().removeprefix("prewarm: failed: ")[:300] if lines else "nothing in its log"

    def stop(self, why: str | None = None) -> None:
        """Stop it if it still runs (its whole session: inductor's compile workers too), saying `why`. Idempotent."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if why:
            self._say(f"compile prewarm: stopped after {self.elapsed():.1f} s: {why}")

    def _say(self, line: str) -> None:
        if not self.said:
            self.said = True
            self.log(line)


class FirstStep:
    """The first step of this process: waits for the compile prewarm before it (`wait_for_prewarm`), and after it
    says how long it took and how many of its graphs inductor's on-disk caches held (`report`), so that a reader
    sees e.g. 'first step 12.3 s after 0.0 s waiting for the compile prewarm: 5 of 5 graphs from inductor's
    FX-graph cache'. Nothing to say for an uncompiled step."""

    def __init__(self, compiled: bool, prewarm: Prewarm | None, log):
        self.compiled, self.prewarm, self.log = compiled, prewarm, log
        self.waited, self.t0, self.before = 0.0, None, None

    def wait_for_prewarm(self, heartbeat=None) -> None:
        if self.prewarm is not None:
            self.waited = self.prewarm.finish(heartbeat)
        self.before, self.t0 = (GraphCacheCounts.snapshot(), CompileSeconds.snapshot()), time.perf_counter()

    def report(self) -> None:
        """After each step; speaks once, after the first."""
        if self.t0 is None:
            return
        seconds, self.t0 = time.perf_counter() - self.t0, None
        if not self.compiled:
            return
        waited = f" after {self.waited:.1f} s waiting for the compile prewarm" if self.prewarm is not None else ""
        graphs, spent = GraphCacheCounts.snapshot() - self.before[0], CompileSeconds.snapshot() - self.before[1]
        self.log(f"first step {seconds:.1f} s{waited}: {graphs.summary()}; {spent.summary()}")
