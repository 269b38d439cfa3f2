"""The real `dflash-train doctor` on this CPU, plus injected hanging and failing stages."""

import json
import os
import re
import subprocess
import sys
import time
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


def run_cli(*args: str, inject: str | None = None, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DFLASH_DOCTOR_INJECT", None)
    if inject:
        env["DFLASH_DOCTOR_INJECT"] = inject
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dflash_train", "doctor", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)
    return proc, time.monotonic() - t0


def stage_lines(stdout: str) -> dict[str, re.Match]:
    return {m[2]: m for m in map(LINE.match, stdout.splitlines()) if m}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    report = tmp_path_factory.mktemp("doctor") / "doctor.json"
    proc, _ = run_cli("--quick", "--devices", "cpu", "--json", str(report))
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
    assert "healthy after warm-up: 0 new graphs" in stages["compile[cpu]"][3]
    attention_s = re.search(r"attention fwd \(flex has no CPU backward\) ([\d.]+)s", stages["compile[cpu]"][3])
    assert float(attention_s[1]) > 0.5  # a cold compile in a fresh cache really happened
    ratio = float(re.search(r"= ([\d.]+)x", stages["speed[cpu]"][3])[1])
    assert ratio > 1.0  # compiled flex beats the dense eager path even on CPU (10x here, 1.9x on 32 cores)
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


def test_a_hanging_stage_is_reported_with_its_stack_and_later_stages_still_run():
    limit = 10
    proc, elapsed = run_cli("--stages", "versions,devices,disk", "--stage-timeout", str(limit),
                            inject="hang:versions,fail:devices", timeout=300)
    stages = stage_lines(proc.stdout)
    assert stages["versions"][1] == "FAIL"
    assert f"no result within the {limit}s stage limit; stuck in _injected_hang" in stages["versions"][3]
    assert "|   File" in proc.stdout and "line" in proc.stdout and "in _injected_hang" in proc.stdout
    assert stages["devices"][1] == "FAIL" and "injected failure" in stages["devices"][3]
    # the doctor went on: the disk stage ran (WARN under 50 GiB free, which depends on the machine)
    assert stages["disk"][1] in ("PASS", "WARN") and "GiB free" in stages["disk"][3]
    assert proc.stdout.strip().splitlines()[-1] == "dflash-train doctor: FAILED (2 FAIL: versions, devices)"
    assert proc.returncode == 1
    assert elapsed < limit + 60  # killed at its limit (plus the stack grace), not left running


def test_an_injected_failure_fails_the_run_with_exit_code_1():
    proc, _ = run_cli("--stages", "disk", inject="fail:disk", timeout=120)
    assert stage_lines(proc.stdout)["disk"][1] == "FAIL"
    assert proc.stdout.strip().splitlines()[-1] == "dflash-train doctor: FAILED (1 FAIL: disk)"
    assert proc.returncode == 1


def test_a_crashing_stage_is_a_fail_not_a_doctor_crash():
    proc, _ = run_cli("--stages", "disk", inject="crash:disk", timeout=120)
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
    import dflash_train.model.target as target_mod
    from dflash_train.diagnostics.stages import stage_target

    monkeypatch.delattr(target_mod, "load_target")
    outcome = stage_target({"target": "smollm2", "device": "cpu"})
    assert outcome["status"] == "FAIL"
    assert "cannot import dflash_train.model.target.load_target" in outcome["figure"]


def test_a_raising_stage_is_a_fail_that_names_the_error(monkeypatch):
    from dflash_train.diagnostics import stages

    def broken(params):
        raise OSError("disk on fire")

    monkeypatch.setitem(stages.STAGES, "disk", broken)
    outcome = stages.run_stage("disk", {})
    assert outcome["status"] == "FAIL" and outcome["figure"] == "OSError: disk on fire"
    assert outcome["data"]["show_log"]
