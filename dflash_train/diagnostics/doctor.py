"""`dflash-train doctor`: staged checks of the machine, each one flushed line, ending in a verdict.

    PASS|WARN|FAIL  <stage>: <measured figure>  [-> what to do]
    ...
    dflash-train doctor: OK (n PASS, m WARN)   |   dflash-train doctor: FAILED (k FAIL: stage, stage)

Every stage runs in its own child process (`stages.py`) under `--stage-timeout`: a stage that hangs
(the compile deadlock of shared/docs/compile-race.md printed nothing for hours) is asked for its
stacks with SIGUSR1, killed, reported as FAIL with those stacks, and the doctor goes on. The compile
stages start one process per device at once, sharing a fresh TORCHINDUCTOR_CACHE_DIR: the layout
training uses. This parent never initialises a device or compiles (torch is imported with the config
tree, nothing more), so nothing a device or the compiler does can wedge it.

Tests inject faults with DFLASH_DOCTOR_INJECT=hang:<stage>,fail:<stage>,crash:<stage> (a stage name
such as `devices` or `compile[cpu]`; `compile` matches every device) or `run_doctor(inject=...)`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

INJECT_ENV = "DFLASH_DOCTOR_INJECT"
STAGE_KINDS = ("versions", "devices", "disk", "compile", "speed", "p2p", "target")
STACK_GRACE_S = 3.0  # time a stuck child gets to write its stacks after SIGUSR1
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass
class Record:
    """One stage outcome, printed as one line and written to --json as is."""

    stage: str
    status: str  # PASS | WARN | FAIL
    figure: str
    advice: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        """The printed form: `STATUS  stage: figure  -> advice`."""
        text = f"{self.status:<4}  {self.stage}: {self.figure}"
        return text + (f"  -> {self.advice}" if self.advice else "")


@dataclass(frozen=True)
class StageSpec:
    """A stage to run: its printed name, the child's stage kind, and the child's parameters."""

    name: str
    kind: str
    params: dict = field(default_factory=dict)


@dataclass
class DoctorOptions:
    devices: str = "all"  # cpu | cuda | all
    target: str | None = None
    json_path: str | None = None
    stage_timeout: float = 300.0
    quick: bool = False
    disk_dir: str | None = None
    stages: tuple[str, ...] = STAGE_KINDS


def parse_inject(text: str | None) -> dict[str, str]:
    """`hang:devices,fail:compile[cpu]` -> {"devices": "hang", "compile[cpu]": "fail"}."""
    inject = {}
    for item in filter(None, (text or "").replace(";", ",").split(",")):
        mode, _, stage = item.strip().partition(":")
        if mode not in ("hang", "fail", "crash") or not stage:
            raise ValueError(f"{INJECT_ENV} item {item!r}: expected hang|fail|crash:<stage>")
        inject[stage] = mode
    return inject


def verdict(records: list[Record]) -> tuple[str, int]:
    """The summary line and the exit code (1 on any FAIL)."""
    fails = [r.stage for r in records if r.status == "FAIL"]
    if fails:
        return f"dflash-train doctor: FAILED ({len(fails)} FAIL: {', '.join(fails)})", 1
    n_pass = sum(r.status == "PASS" for r in records)
    return f"dflash-train doctor: OK ({n_pass} PASS, {len(records) - n_pass} WARN)", 0


# ---------------------------------------------------------------------------------------------
# What to run


def _device_list(devices: str, n_gpus: int) -> list[str]:
    """Devices to compile on; `cuda` without a visible GPU still gets cuda:0, whose stage then says why."""
    cpu = ["cpu"] if devices in ("cpu", "all") else []
    gpus = [f"cuda:{i}" for i in range(n_gpus)] if devices in ("cuda", "all") else []
    if devices == "cuda" and not gpus:
        gpus = ["cuda:0"]
    return cpu + gpus


def first_stages(opts: DoctorOptions) -> list[list[StageSpec]]:
    """Stages that do not depend on what the machine has."""
    return [[StageSpec("versions", "versions")], [StageSpec("devices", "devices", {"devices": opts.devices})],
            [StageSpec("disk", "disk", {"dir": opts.disk_dir or os.getcwd()})]]


def later_stages(opts: DoctorOptions, n_gpus: int) -> list[list[StageSpec]]:
    """Per-device stages (one group = processes started together), p2p, and the target."""
    devices = _device_list(opts.devices, n_gpus)
    quick = {"quick": opts.quick}
    groups = [[StageSpec(f"compile[{d}]", "compile", {"device": d, **quick}) for d in devices],
              [StageSpec(f"speed[{d}]", "speed", {"device": d, **quick}) for d in devices]]
    if "cpu" in devices:
        groups.append([StageSpec("p2p[gloo]", "p2p", {"backend": "gloo", **quick})])
    if any(d.startswith("cuda") for d in devices):
        if n_gpus >= 2:
            groups.append([StageSpec("p2p[nccl]", "p2p", {"backend": "nccl", **quick})])
        else:
            groups.append([StageSpec("p2p[nccl]", "note", {
                "status": "WARN", "figure": f"skipped: {n_gpus} GPU visible, NCCL point-to-point needs 2",
                "advice": "NCCL refuses two ranks on one GPU; run the doctor on a machine with 2+ GPUs"})])
    if opts.target:
        device = "cuda:0" if n_gpus and opts.devices != "cpu" else "cpu"
        groups.append([StageSpec("target", "target", {"target": opts.target, "device": device, **quick})])
    return groups


# ---------------------------------------------------------------------------------------------
# Running one stage child


@dataclass
class _Child:
    spec: StageSpec
    proc: subprocess.Popen
    result_path: Path
    log_path: Path
    started: float


def child_env(workdir: Path) -> dict[str, str]:
    """The children's environment: a fresh inductor/triton cache shared by all of them, unbuffered."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor-cache")
    env["TRITON_CACHE_DIR"] = str(workdir / "triton-cache")
    env["PYTHONUNBUFFERED"] = "1"
    package_root = str(Path(__file__).resolve().parents[2])  # importable even when not installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env.pop(INJECT_ENV, None)  # the child gets its injection in its parameters, never by accident
    return env


def _launch(spec: StageSpec, workdir: Path, env: dict, inject: str | None) -> _Child:
    """Start one stage child; its stdout and stderr go to a log file in `workdir`."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", spec.name)
    result_path, log_path = workdir / f"{slug}.json", workdir / f"{slug}.log"
    params = dict(spec.params, inject=inject)
    cmd = [sys.executable, "-m", "dflash_train.diagnostics.stages", spec.kind, json.dumps(params), str(result_path)]
    with open(log_path, "wb") as log:
        # A new session: the stage and everything it spawns (p2p ranks, compile workers) form one
        # process group that SIGUSR1 and the kill reach together.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    return _Child(spec, proc, result_path, log_path, time.monotonic())


def _signal_group(child: _Child, sig: int) -> None:
    """Signal the child and everything it started (its own session/process group)."""
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read_log(child: _Child) -> str:
    """The child's combined output so far."""
    try:
        return child.log_path.read_text(errors="replace")
    except OSError:
        return ""


def stack_lines(log_text: str, limit: int = 160) -> list[str]:
    """The faulthandler dumps in a child's log: from the first thread header on."""
    lines = log_text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith(("Current thread 0x", "Thread 0x"))), None)
    return [] if start is None else lines[start:start + limit]


def innermost_frame(stacks: list[str]) -> str:
    """`func (file:line)` where the first dumped thread (the main one, which takes the signal) sits."""
    for line in stacks:
        m = _FRAME.search(line)
        if m:
            return f"{m['func']} ({Path(m['file']).name}:{m['line']})"
    return "unknown (no Python frame dumped)"


def _timed_out(child: _Child, timeout: float) -> tuple[Record, list[str], dict]:
    """Ask the stuck group for stacks, give it a moment to write them, kill it, report."""
    _signal_group(child, signal.SIGUSR1)
    size, deadline = -1, time.monotonic() + STACK_GRACE_S
    while time.monotonic() < deadline:  # stop waiting once the dump stops growing
        time.sleep(0.5)
        new = child.log_path.stat().st_size if child.log_path.exists() else 0
        if new == size:
            break
        size = new
    _signal_group(child, signal.SIGKILL)
    child.proc.wait()
    stacks = stack_lines(_read_log(child))
    record = Record(child.spec.name, "FAIL", f"no result within the {timeout:.0f}s stage limit; stuck in "
                    f"{innermost_frame(stacks)}",
                    "the stacks below show where; if the machine is just slow, raise --stage-timeout",
                    time.monotonic() - child.started)
    return record, stacks, {}


def _log_tail(child: _Child, n: int = 25) -> list[str]:
    """The last `n` non-empty lines of the child's output."""
    return [l for l in _read_log(child).splitlines() if l.strip()][-n:]


def _finished(child: _Child) -> tuple[Record, list[str], dict]:
    """Read a finished child's result; a child that died without one is a FAIL with its log tail."""
    seconds = time.monotonic() - child.started
    try:
        outcome = json.loads(child.result_path.read_text())
    except (OSError, ValueError):
        tail = _log_tail(child)
        last = tail[-1].strip()[:200] if tail else "no output"
        return Record(child.spec.name, "FAIL", f"stage process exited with code {child.proc.returncode} "
                      f"without a result: {last}", "see its output below", seconds), tail, {}
    data = outcome.get("data") or {}
    record = Record(child.spec.name, outcome["status"], outcome["figure"], outcome.get("advice", ""), seconds)
    return record, (_log_tail(child) if data.get("show_log") else []), data


# ---------------------------------------------------------------------------------------------
# The doctor


class Doctor:
    """Runs stage groups in order, prints each record as one flushed line, keeps going after failures."""

    def __init__(self, opts: DoctorOptions, inject: dict[str, str] | None = None, out: TextIO | None = None):
        self.opts = opts
        self.inject = inject or {}
        self.out = out or sys.stdout
        self.records: list[Record] = []
        self.data: dict[str, dict] = {}  # stage name -> the data its child returned (e.g. n_gpus)
        self._live: list[_Child] = []

    def _print(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _inject_for(self, spec: StageSpec) -> str | None:
        """The injected fault for this stage, by exact name or by kind."""
        return self.inject.get(spec.name) or self.inject.get(spec.kind)

    def run(self) -> int:
        """All stages, then the verdict line; returns the exit code."""
        workdir = Path(tempfile.mkdtemp(prefix="dflash-doctor-"))
        env = child_env(workdir)
        self._print(f"dflash-train doctor: devices={self.opts.devices} quick={self.opts.quick} stage limit "
                    f"{self.opts.stage_timeout:.0f}s, fresh inductor cache {env['TORCHINDUCTOR_CACHE_DIR']}")
        try:
            for group in first_stages(self.opts):
                self._run_group(group, workdir, env)
            n_gpus = int(self.data.get("devices", {}).get("n_gpus", 0))
            for group in later_stages(self.opts, n_gpus):
                self._run_group(group, workdir, env)
        finally:
            for child in self._live:  # interrupted (Ctrl-C): leave no stage processes behind
                _signal_group(child, signal.SIGKILL)
            shutil.rmtree(workdir, ignore_errors=True)
        line, code = verdict(self.records)
        if self.opts.json_path:
            self._write_json(line, code)
        self._print(line)
        return code

    def _run_group(self, group: list[StageSpec], workdir: Path, env: dict) -> None:
        """Start every stage of the group at once; wait for all of them or the shared deadline."""
        group = [s for s in group if s.kind in self.opts.stages or s.name.split("[")[0] in self.opts.stages]
        notes = [s for s in group if s.kind == "note"]
        for spec in notes:
            self._emit(Record(spec.name, spec.params["status"], spec.params["figure"], spec.params["advice"]), [])
        self._live = [_launch(s, workdir, env, self._inject_for(s)) for s in group if s.kind != "note"]
        deadline = time.monotonic() + self.opts.stage_timeout
        while any(c.proc.poll() is None for c in self._live) and time.monotonic() < deadline:
            time.sleep(0.2)
        for child in self._live:
            done = child.proc.poll() is not None
            record, extra, data = _finished(child) if done else _timed_out(child, self.opts.stage_timeout)
            self.data[child.spec.name] = data
            self._emit(record, extra)
        self._live = []

    def _emit(self, record: Record, extra: list[str]) -> None:
        """Record and print one stage line (kept to one line), then any stacks/log lines indented."""
        record.figure = record.figure.replace("\n", " ").replace("  -> ", " -> ")
        record.advice = record.advice.replace("\n", " ")
        record.seconds = round(record.seconds, 2)
        self.records.append(record)
        self._print(record.line())
        for line in extra:
            self._print(f"      | {line}")

    def _write_json(self, verdict_line: str, code: int) -> None:
        """--json: the same records as the printed lines, plus the verdict."""
        report = {"records": [asdict(r) for r in self.records], "verdict": verdict_line, "exit_code": code,
                  "options": asdict(self.opts)}
        Path(self.opts.json_path).write_text(json.dumps(report, indent=2) + "\n")


def run_doctor(opts: DoctorOptions, inject: dict[str, str] | None = None, out: TextIO | None = None) -> int:
    """Run the doctor; `inject` defaults to $DFLASH_DOCTOR_INJECT."""
    if inject is None:
        inject = parse_inject(os.environ.get(INJECT_ENV))
    return Doctor(opts, inject, out).run()
