"""`train.profile_steps`: where a training step's time goes, measured on the real loop.

After `START_AFTER` steps of this process (the compile, the prewarm's wait and the first allocations are
behind), `StepProfiler` runs torch.profiler (CPU, plus CUDA on a GPU; no shapes, no stacks) over
`train.profile_steps` passes of the loop, each a `step N` range holding a `taps` range (receiving, reading
or computing the step's taps) and a `train_step` range (forward, backward, optimizer). Then it writes
`<out_dir>/profile/`: `trace.json.gz` (ui.perfetto.dev or chrome://tracing), `summary.txt` (torch's op table,
25 rows by self device time, by self CPU time on a CPU) and `summary.json` (the figures of `_figures`, the
host's top ops among them), and logs one line, which says when the device idles waiting for the host. It
only observes: the step's numbers are unchanged (the device is synchronized at both ends of the window,
for the wall clock). A failure of its own is said in one line and the run goes on
without it. Only the main drafter rank profiles (train/loop.py).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import time
from pathlib import Path

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile, record_function

from dflash_train import atomic
from dflash_train.train.optim.optimizer import DECIDE_AFTER

TRACE = "trace.json.gz"  # gzipped (Perfetto and chrome://tracing read it): ten H100 steps' JSON was too large to come
# back from the device machine (session 26)
START_AFTER = 3  # loop passes of this process before the window: a compiled step's graphs are built by then
TABLE_ROWS = 25
TOP_OPS = 10
PHASES = ("taps", "train_step")  # ranges the loop opens inside a step (`StepProfiler.phase`)
STEP_RANGES = ("forward", "drafter_forward", "backward")  # ranges train/step.py opens inside train_step
OPTIMIZER = "Optimizer.step#"  # torch.optim's own range around every optimizer's step
HOST_NOTE = ("host time in the loop's ranges: taps (receive, read or compute the step's taps), train_step (forward, "
             "backward, optimizer), inside it forward (the drafter's forward, drafter_forward, then the loss's "
             "forward), backward and optimizer (torch.optim's steps), rest_of_loop (wall - taps - train_step: stop "
             "votes, logging, a held-out eval or checkpoint that fell due)")


def profiled(name: str):
    """A named range while a profiler records, else nothing: 0.3 us a call against record_function's 4.9 us
    without a profiler (this 2-core box), for ranges on the training step's hot path."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class StepProfiler:
    """Call `before_step(n)` / `after_step(n)` around each pass of the loop and `close()` after it."""

    def __init__(self, steps: int, device: torch.device, out_dir: str | Path, log, start_after: int = START_AFTER,
                 budget_undecided: bool = False):
        # a time budget measures the step rate over this process's steps 11-30 (optim.TimeBudget): profiled steps
        # there would make it plan fewer, so the window waits for its decision
        self.start_after = max(start_after, DECIDE_AFTER) if budget_undecided else start_after
        self.steps, self.device, self.log = steps, device, log
        self.dir = Path(out_dir) / "profile"
        self.cuda = device.type == "cuda"
        self.passes = 0  # loop passes of this process so far
        self.done = steps <= 0
        self.prof = None
        self.open = None  # the `step N` range of the pass under way
        self.first = self.last = None
        self.t0 = 0.0

    def before_step(self, step: int) -> None:
        if self.done or self.passes < self.start_after:
            return
        with self._guard("starting"):
            if self.prof is None:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
                self._sync()  # nothing of the steps before runs inside the window
                self.prof = profile(activities=activities, record_shapes=False, with_stack=False)
                self.prof.start()
                self.first, self.t0 = step, time.perf_counter()
            self.open = record_function(f"step {step}")
            self.open.__enter__()

    def phase(self, name: str):
        """A named range inside the step while the profiler records; nothing otherwise."""
        return record_function(name) if self.open is not None else contextlib.nullcontext()

    def after_step(self, step: int) -> None:
        self.passes += 1
        if self.open is None:
            return
        with self._guard("recording"):
            self._close_range()
            self.last = step
        if not self.done and step - self.first + 1 >= self.steps:
            with self._guard("writing"):
                self._finish()

    def close(self) -> None:
        """The loop ended: a window it cut short is written with the steps it holds."""
        if self.done:
            return
        if self.prof is None:
            self.log(f"profile: the run ended after {self.passes} steps of this process, before the profile's "
                     f"window (it starts after {self.start_after}): nothing written")
            self.done = True
            return
        with self._guard("writing"):
            self._close_range()
            self._finish()

    def _finish(self) -> None:
        self._sync()
        wall_s = time.perf_counter() - self.t0
        prof, self.prof, self.done = self.prof, None, True
        prof.stop()
        averages, steps = prof.key_averages(), self.last - self.first + 1
        figures = _figures(prof.events(), averages, steps, self.first, self.last, wall_s, self.cuda)
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        atomic.write_with(self.dir / TRACE, lambda tmp: _gzipped_trace(prof, Path(tmp)))
        atomic.write_text(self.dir / "summary.txt", averages.table(sort_by=sort_by, row_limit=TABLE_ROWS))
        atomic.write_text(self.dir / "summary.json", json.dumps(figures, indent=2) + "\n")
        self.log(_line(figures, self.dir / "summary.txt"))

    def _close_range(self) -> None:
        opened, self.open = self.open, None
        if opened is not None:
            opened.__exit__(None, None, None)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _guard(self, doing: str):
        """Any failure of the profiler: one line, the profiler stopped, the run goes on without it."""
        try:
            yield
        except Exception as e:  # noqa: BLE001: a profile must never stop a training run
            self.done, prof, self.prof = True, self.prof, None
            with contextlib.suppress(Exception):
                self._close_range()
            self.open = None
            if prof is not None:
                with contextlib.suppress(Exception):
                    prof.stop()
            first_line = (str(e).splitlines() or [""])[0]
            self.log(f"profile: failed while {doing} ({type(e).__name__}: {first_line}); training goes on without it")


def _gzipped_trace(prof, path: Path) -> None:
    """torch's Chrome trace, written beside `path` and gzipped into it."""
    raw = path.with_name(path.name + ".json")
    try:
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
    finally:
        raw.unlink(missing_ok=True)


def _figures(events, averages, steps: int, first: int, last: int, wall_s: float, cuda: bool) -> dict:
    """summary.json: per step, the wall time, the device's busy time (the union of its kernels' and copies'
    intervals; None on a CPU), the host time of the loop's ranges, and the ops that cost most."""
    wall_ms = wall_s * 1000.0 / steps
    host = {name: _ms_per_step(us, steps) for name, us in _host_us(events).items()}
    host["rest_of_loop"] = round(max(0.0, wall_ms - host["taps"] - host["train_step"]), 3)
    busy_ms, device_ops = None, None
    if cuda:  # kernels, copies and sets; not the device-side copies of the host's ranges (by flag or by name)
        ranges = {e.name for e in events if e.device_type == DeviceType.CPU and e.is_user_annotation}
        device = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation
                  and e.name not in ranges]
        busy_ms = _ms_per_step(_union_us([(e.time_range.start, e.time_range.end) for e in device]), steps)
        device_ops = round(len(device) / steps, 1)
    ops = [a for a in averages if a.device_type == DeviceType.CPU
           and not getattr(a, "is_user_annotation", False) and not a.key.startswith(OPTIMIZER)]
    return {"steps": steps, "first_step": first, "last_step": last, "device": "cuda" if cuda else "cpu",
            "wall_ms_per_step": round(wall_ms, 3), "device_busy_ms_per_step": busy_ms,
            "device_idle_share": None if busy_ms is None else round(max(0.0, 1.0 - busy_ms / wall_ms), 4),
            "device_ops_per_step": device_ops,
            "host_ms_per_step": host, "host_note": HOST_NOTE,
            "top_ops_by": "self device time" if cuda else "self CPU time",
            "top_ops": _top(ops, "self_device_time_total" if cuda else "self_cpu_time_total", steps),
            # where the host's time goes, on a GPU too: a step whose device idles waits for these
            "top_host_ops": _top(ops, "self_cpu_time_total", steps)}


def _top(ops: list, key: str, steps: int) -> list[dict]:
    """The TOP_OPS ops costing most by `key`, per step."""
    ops = sorted(ops, key=lambda a: getattr(a, key), reverse=True)[:TOP_OPS]
    return [{"name": a.key, "ms_per_step": _ms_per_step(getattr(a, key), steps), "calls_per_step": a.count / steps}
            for a in ops]


def _host_us(events) -> dict:
    """Host microseconds in each of the loop's ranges and in torch.optim's steps (the outermost, where
    one optimizer steps others)."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    spent = {name: sum(e.time_range.elapsed_us() for e in cpu if e.name == name) for name in PHASES + STEP_RANGES}
    spent["optimizer"] = sum(e.time_range.elapsed_us() for e in cpu
                             if e.name.startswith(OPTIMIZER) and not _inside_optimizer(e.cpu_parent))
    return spent


def _ms_per_step(us: float, steps: int) -> float:
    return round(us / 1000.0 / steps, 3)


def _inside_optimizer(event) -> bool:
    while event is not None:
        if event.name.startswith(OPTIMIZER):
            return True
        event = event.cpu_parent
    return False


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlapping kernels on several streams count once)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


HOST_BOUND_IDLE = 0.5  # a device idle for more than this share of the wall waits for the host's dispatch


def _line(f: dict, table: Path) -> str:
    busy = ("n/a (CPU)" if f["device_busy_ms_per_step"] is None
            else f"{f['device_busy_ms_per_step']:.1f} ms ({1 - f['device_idle_share']:.0%}; "
                 f"{f['device_ops_per_step']:.0f} kernels and copies)")
    host = ", ".join(f"{name} {_ms(ms)}" for name, ms in f["host_ms_per_step"].items())
    top = ", ".join(f"{op['name'][:48]} {_ms(op['ms_per_step'])} ms" for op in f["top_ops"][:3])
    bound = ""
    if f["device_idle_share"] is not None and f["device_idle_share"] > HOST_BOUND_IDLE:
        host_top = ", ".join(f"{op['name'][:32]} x{op['calls_per_step']:.0f}" for op in f["top_host_ops"][:3])
        bound = (f"; host-bound: the device idles {f['device_idle_share']:.0%} of the step waiting for the host "
                 f"(its top ops: {host_top}); more rows per step amortise the dispatch")
    return (f"profile: steps {f['first_step']}-{f['last_step']}: {f['wall_ms_per_step']:.1f} ms/step wall, device busy "
            f"{busy}, host ms/step {host}; top ({f['top_ops_by']}): {top}{bound}; {table}")


def _ms(ms: float) -> str:
    return f"{ms:.1f}" if ms >= 1 else f"{ms:.2g}"
