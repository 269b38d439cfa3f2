"""`dflash-train prepare` under torchrun in target groups (real gloo): 4 processes in 2 groups of 2,
each group's target sharded over its ranks, write the same samples and taps as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main
from dflash_train.data.shards import ShardReader

pytestmark = pytest.mark.slow

SAFETY_S = 300  # a bound on waiting only; no duration is asserted


def _args(target: Path, out: Path) -> list[str]:
    return ["prepare", "--target", str(target), "--data", "chitchat", "--out", str(out), "--max-samples", "10",
            "--max-len", "96", "--num-taps", "2", "--shard-mb", "0.02"]


def _prepare_in_groups(target: Path, out: Path, nproc: int, group_size: int) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--monitor-interval=0.5", "-m", "dflash_train"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(launcher + _args(target, out) + [f"topology.target_group_size={group_size}"], env=env,
                          capture_output=True, text=True, timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _by_id(directory: Path) -> dict[str, dict]:
    reader = ShardReader(directory, verify="open", dtype=torch.float32)
    return {row["id"]: row for row in (reader.sample(i) for i in range(len(reader)))}


def test_two_target_groups_of_two_write_what_one_process_writes(tiny_qwen3_dir, tmp_path):
    assert main(_args(tiny_qwen3_dir, tmp_path / "one") + ["--device", "cpu"]) == 0  # the reference: one process
    grouped = _prepare_in_groups(tiny_qwen3_dir, tmp_path / "grouped", 4, 2)
    assert grouped.stdout.count("dflash-train prepare: OK") == 4
    assert grouped.stdout.count("target: sharded over ranks [0, 1]") == 2
    assert grouped.stdout.count("target: sharded over ranks [2, 3]") == 2
    assert grouped.stdout.count("(computes, its first rank writes)") == 2  # ranks 1 and 3 write nothing
    index = json.loads((tmp_path / "grouped" / "index.json").read_text())
    assert index["groups"] == 2 and index["complete"]
    assert {entry["file"].split("/")[0] for entry in index["shards"]} == {"group-00000", "group-00001"}
    assert len(index["shards"]) > 2  # several shards per group: the order over files is exercised
    expected, got = _by_id(tmp_path / "one"), _by_id(tmp_path / "grouped")
    assert sorted(got) == sorted(expected) and len(got) >= 4
    for sample_id, row in expected.items():
        assert torch.equal(got[sample_id]["input_ids"], row["input_ids"]), sample_id
        # bf16 storage of taps that sharding changes by ~1e-6 relative: at most one bf16 step apart
        torch.testing.assert_close(got[sample_id]["taps"], row["taps"], rtol=2 ** -7, atol=1e-5, msg=sample_id)
