"""`dflash-train regenerate` under torchrun in target groups (real gloo): 4 processes in 2 groups of
2, each group's target sharded over its ranks, write the same greedy replies as one process, and a
re-run resumes (adds nothing, changes nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.data.regenerate import group_part

pytestmark = pytest.mark.slow

SAFETY_S = 300  # a bound on waiting only; no duration is asserted


def _args(target: Path, out: Path) -> list[str]:
    return ["regenerate", "--target", str(target), "--data", "chitchat", "--out", str(out), "--max-samples", "9",
            "--max-new-tokens", "12", "--batch-size", "3", "--thinking", "off"]


def _in_groups(target: Path, out: Path) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                "--monitor-interval=0.5", "-m", "dflash_train"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(launcher + _args(target, out) + ["topology.target_group_size=2"], env=env,
                          capture_output=True, text=True, timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("dflash-train regenerate: OK") == 4
    return proc


def _rows(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_id = {row["id"]: row for row in rows}
    assert len(by_id) == len(rows), "duplicate ids"
    return by_id


def test_two_target_groups_of_two_write_what_one_process_writes(tiny_qwen3_dir, tmp_path):
    assert main(_args(tiny_qwen3_dir, tmp_path / "one.jsonl") + ["--device", "cpu"]) == 0  # the reference
    out = tmp_path / "grouped.jsonl"
    proc = _in_groups(tiny_qwen3_dir, out)
    assert proc.stdout.count("target: sharded over ranks [0, 1]") == 2
    assert proc.stdout.count("target: sharded over ranks [2, 3]") == 2
    assert proc.stdout.count("(computes, its first rank writes)") == 2  # ranks 1 and 3 write nothing
    assert "9 rows merged from 2 group parts" in proc.stdout
    expected, got = _rows(tmp_path / "one.jsonl"), _rows(out)
    assert sorted(got) == sorted(expected) and len(got) == 9
    for row_id, row in expected.items():
        assert got[row_id]["messages"] == row["messages"], row_id  # greedy: the same replies
    assert {len(_rows(group_part(out, g))) for g in range(2)} == {4, 5}  # contiguous shares of 9
    before = out.read_bytes()
    again = _in_groups(tiny_qwen3_dir, out)  # resumes: nothing left to generate, nothing to merge
    assert "0 rows merged from 2 group parts" in again.stdout and again.stdout.count("0 new + ") == 4
    assert out.read_bytes() == before
