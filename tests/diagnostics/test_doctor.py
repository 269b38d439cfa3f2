"""The real `dflash-train doctor` on this CPU, plus injected hanging and failing stages."""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dflash_train.diagnostics.doctor import (
    DoctorOptions,
    Record,
    innermost_frame,
    later_stages,
    parse_inject,
    stack_lines,
    verdict,
)

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(PASS|WARN|FAIL)  (\S+): (.*?)(?:  -> (.*))?$")
VERDICT = re.compile(r"^dflash-train doctor: (OK \((\d+) PASS, (\d+) WARN\)|FAILED \((\d+) FAIL: (.*)\))$")


def run_cli(*args: str, inject: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The doctor as a user runs it. `timeout` is only a safety bound: past it the test fails with
    TimeoutExpired; no test asserts how long the doctor took."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DFLASH_DOCTOR_INJECT", None)
    if inject:
        env["DFLASH_DOCTOR_INJECT"] = inject
    return subprocess.run([sys.executable, "-m", "dflash_train", "doctor", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def stage_lines(stdout: str) -> dict[str, re.Match]:
    return {m[2]: m for m in map(LINE.match, stdout.splitlines()) if m}


HANG_LIMIT = 4  # the hanging stage's --stage-timeout (test_a_hanging_stage_...)


@pytest.fixture(scope="module")
def doctor_runs(tmp_path_factory):
    """The module's doctor runs, started together: the quick run (~30 s, one stage at a time) and the three injected
    ones, which mostly wait (out a stage limit, or on a child's start) and so fit beside it on a 2-core box. Each
    test takes its own run's result."""
    report = tmp_path_factory.mktemp("doctor") / "doctor.json"
    runs = {"quick": (("--quick", "--devices", "cpu", "--json", str(report)), None, 600),
            "hang": (("--stages", "versions,devices,disk", "--stage-timeout", str(HANG_LIMIT)),
                     "hang:versions,fail:devices", 300),
            "fail": (("--stages", "disk"), "fail:disk", 120),
            "crash": (("--stages", "disk"), "crash:disk", 120)}
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        yield {name: pool.submit(run_cli, *args, inject=inject, timeout=timeout)
               for name, (args, inject, timeout) in runs.items()}, report


@pytest.fixture(scope="module")
def quick_run(doctor_runs):
    runs, report = doctor_runs
    proc = runs["quick"].result()
    return proc, json.loads(report.read_text())


def test_quick_doctor_on_cpu_ends_with_an_ok_verdict(quick_run):
    proc, _ = quick_run
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    m = VERDICT.match(lines[-1])
    assert m and lines[-1].startswith("dflash-train doctor: OK")
    stages = stage_lines(proc.stdout)
    assert list(stages) == ["versions", "devices", "disk", "compile[cpu]", "speed[cpu]", "p2p[gloo]"]
    assert int(m[2]) + int(m[3]) == len(stages)
    assert "torch 2." in stages["versions"][3]
    assert re.search(r"FX-tracing flag (process-wide|per-thread)$", stages["versions"][3])
    # the compiled flex path ran (no eager fallback) and stayed compiled after warm-up
    assert "healthy after warm-up: 0 new graphs" in stages["compile[cpu]"][3]
    assert "0 eager flex calls" in stages["compile[cpu]"][3]
    assert re.search(r"attention fwd \(flex has no CPU backward\) [\d.]+s", stages["compile[cpu]"][3])
    # the speed figure is eager / compiled of the two timings it prints (how fast is the machine's business)
    speed = re.search(r"compiled ([\d.]+) ms vs eager ([\d.]+) ms per fwd = ([\d.]+)x", stages["speed[cpu]"][3])
    compiled_ms, eager_ms, ratio = map(float, speed.groups())
    assert compiled_ms > 0 and eager_ms > 0
    assert ratio == pytest.approx(eager_ms / compiled_ms, abs=0.06, rel=0.02)  # printed to 0.1x and 0.01 ms
    assert float(re.search(r"([\d.]+) GB/s", stages["p2p[gloo]"][3])[1]) > 0


def test_json_report_matches_the_printed_lines(quick_run):
    proc, report = quick_run
    printed = [m for m in map(LINE.match, proc.stdout.splitlines()) if m]
    assert len(report["records"]) == len(printed)
    for rec, m in zip(report["records"], printed):
        assert (rec["status"], rec["stage"], rec["figure"], rec["advice"]) == (m[1], m[2], m[3], m[4] or "")
        assert rec["seconds"] > 0
    assert report["verdict"] == proc.stdout.strip().splitlines()[-1]
    assert report["exit_code"] == proc.returncode == 0


def test_a_hanging_stage_is_reported_with_its_stack_and_later_stages_still_run(doctor_runs):
    """The hung stage is stopped at its limit and its stack shown; the doctor goes on to the next
    stages and exits 1. Had the hung stage process been left running, it would hold the output pipe
    open and `run_cli` would fail on its timeout instead of returning. The limit holds each group (one
    stage here) from its child's start: the hung child reaches its hang in ~0.1 s, the disk stage ends in
    ~0.2 s, so 4 s leaves them a 20x slower machine and waits out little."""
    limit = HANG_LIMIT
    proc = doctor_runs[0]["hang"].result()
    stages = stage_lines(proc.stdout)
    assert stages["versions"][1] == "FAIL"
    assert f"no result within the {limit}s stage limit; stuck in _injected_hang" in stages["versions"][3]
    assert "|   File" in proc.stdout and "line" in proc.stdout and "in _injected_hang" in proc.stdout
    assert stages["devices"][1] == "FAIL" and "injected failure" in stages["devices"][3]
    # the doctor went on: the disk stage ran (WARN under 50 GiB free, which depends on the machine)
    assert stages["disk"][1] in ("PASS", "WARN") and "GiB free" in stages["disk"][3]
    assert proc.stdout.strip().splitlines()[-1] == "dflash-train doctor: FAILED (2 FAIL: versions, devices)"
    assert proc.returncode == 1
    order = [m[2] for m in map(LINE.match, proc.stdout.splitlines()) if m]
    assert order == ["versions", "devices", "disk"]  # reported in plan order, the hung one first


def test_an_injected_failure_fails_the_run_with_exit_code_1(doctor_runs):
    proc = doctor_runs[0]["fail"].result()  # run_cli("--stages", "disk", inject="fail:disk")
    assert stage_lines(proc.stdout)["disk"][1] == "FAIL"
    assert proc.stdout.strip().splitlines()[-1] == "dflash-train doctor: FAILED (1 FAIL: disk)"
    assert proc.returncode == 1


def test_a_crashing_stage_is_a_fail_not_a_doctor_crash(doctor_runs):
    proc = doctor_runs[0]["crash"].result()  # run_cli("--stages", "disk", inject="crash:disk")
    assert "stage process exited with code 7 without a result" in stage_lines(proc.stdout)["disk"][3]
    assert proc.returncode == 1


def test_parse_inject_and_verdict():
    assert parse_inject("hang:compile[cpu], fail:disk") == {"compile[cpu]": "hang", "disk": "fail"}
    assert parse_inject(None) == {}
    with pytest.raises(ValueError):
        parse_inject("explode:disk")
    recs = [Record("a", "PASS", "x"), Record("b", "WARN", "y", "do z"), Record("c", "FAIL", "w")]
    assert verdict(recs[:2]) == ("dflash-train doctor: OK (1 PASS, 1 WARN)", 0)
    assert verdict(recs) == ("dflash-train doctor: FAILED (1 FAIL: c)", 1)
    assert recs[1].line() == "WARN  b: y  -> do z"


def test_stack_parsing():
    log = ("noise\nThread 0x00007f (most recent call first):\n"
           '  File "/x/stages.py", line 223 in _injected_hang\n  File "/x/stages.py", line 9 in main\n')
    lines = stack_lines(log)
    assert lines[0].startswith("Thread 0x") and len(lines) == 3
    assert innermost_frame(lines) == "_injected_hang (stages.py:223)"


def test_plan_per_device_and_p2p():
    names = lambda groups: [[s.name for s in g] for g in groups]  # noqa: E731
    assert names(later_stages(DoctorOptions(devices="all"), 2)) == [
        ["compile[cpu]", "compile[cuda:0]", "compile[cuda:1]"], ["speed[cpu]", "speed[cuda:0]", "speed[cuda:1]"],
        ["p2p[gloo]"], ["p2p[nccl]"]]
    one_gpu = later_stages(DoctorOptions(devices="cuda", target="smollm2"), 1)
    assert names(one_gpu) == [["compile[cuda:0]"], ["speed[cuda:0]"], ["p2p[nccl]"], ["target"]]
    assert one_gpu[2][0].kind == "note" and one_gpu[2][0].params["status"] == "WARN"
    assert one_gpu[3][0].params["device"] == "cuda:0"


def test_target_stage_names_a_missing_loader(monkeypatch):
    import dflash_train.model.target.load as target_mod
    from dflash_train.diagnostics.stages import stage_target

    monkeypatch.delattr(target_mod, "load_target")
    outcome = stage_target({"target": "smollm2", "device": "cpu"})
    assert outcome["status"] == "FAIL"
    assert "cannot import dflash_train.model.target.load.load_target" in outcome["figure"]


def test_a_raising_stage_is_a_fail_that_names_the_error(monkeypatch):
    from dflash_train.diagnostics import stages

    def broken(params):
        raise OSError("disk on fire")

    monkeypatch.setitem(stages.STAGES, "disk", broken)
    outcome = stages.run_stage("disk", {})
    assert outcome["status"] == "FAIL" and outcome["figure"] == "OSError: disk on fire"
    assert outcome["data"]["show_log"]
