"""The curve (bench/curve.py): each point a `dflash-train train` run of its own, data scaled with the minutes;
finished points are skipped, the table and plot are rebuilt from what the points wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import curve
from dflash_train import recipes

REPO = Path(__file__).resolve().parents[1]


def test_points_grow_the_data_with_the_target_writing_the_rest():
    points = curve.points_of(curve.parse([]))
    assert [(p.minutes, p.samples, p.mix) for p in points] == [
        (3.5, 15000, "default:0.4,code:0.2,synthesize:0.4"), (10.0, 30000, "default:0.3,code:0.1,synthesize:0.6"),
        (20.0, 45000, "default:0.2,code:0.07,synthesize:0.73")]
    gpu, long = recipes.gpu(), recipes.gpu_long()
    assert (gpu.train.max_minutes, gpu.data.max_samples, gpu.data.train) == (3.5, 15000, points[0].mix)
    assert (long.train.max_minutes, long.data.max_samples, long.data.train) == (20.0, 45000, points[2].mix)
    assert curve.points_of(curve.parse(["--points", "7", "--samples", "7=21000"]))[0].mix == \
        "default:0.4,code:0.14,synthesize:0.46"
    with pytest.raises(SystemExit, match="no data size for the 7-minute point"):
        curve.points_of(curve.parse(["--points", "7"]))


def test_a_common_data_train_replaces_the_points_mix(tmp_path):
    a = curve.parse(["data.train=mine.jsonl"])
    cmd = curve.command(a, curve.Point(10.0, 30000), tmp_path, resume=True)
    assert "data.train=mine.jsonl" in cmd and not any(c.startswith("data.train=default") for c in cmd)
    assert cmd[-1] == "--resume" and "train.max_minutes=10" in cmd and "data.max_samples=30000" in cmd


@pytest.mark.slow
def test_two_tiny_points_then_a_rerun_skips_them(tiny_qwen3_dir, tmp_path):
    out = tmp_path / "curve"
    cmd = [sys.executable, "bench/curve.py", "--recipe", "tiny", "--points", "0.05,0.1", "--samples", "0.05=10,0.1=12",
           "--out", str(out), f"target.model={tiny_qwen3_dir}", "drafter.num_taps=2", "eval.num_prompts=1",
           "eval.max_new_tokens=8", "eval.prompts=chitchat", "data.train=default"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "VERDICT curve: OK 2 of 2 points" in first.stdout, first.stdout + first.stderr
    rows = json.loads((out / "curve.json").read_text())
    assert [(r["minutes"], r["samples"]) for r in rows] == [(0.05, 10), (0.1, 12)]
    assert all(r["steps"] >= 1 and 1.0 <= r["tau"]["chitchat"] <= 4.0 for r in rows)
    assert (out / "curve.png").stat().st_size > 0 and "| 0.1 | 12 |" in (out / "curve.md").read_text()
    assert not list((out / "m0.05" / "data").glob("tapped-*"))  # a finished point's tap cache is deleted
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "starting" not in again.stdout and "m0.1: done" in again.stdout
    assert json.loads((out / "curve.json").read_text()) == rows
