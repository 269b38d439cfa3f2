"""The peer at equal data and GPU time (bench/peers/peer_train.py) on the CPU at tiny shapes: speculators'
own DSpark trains a few steps on our recipe's samples and taps, its checkpoint is read back by our eval, and
the script ends with its verdict. Skipped where speculators 0.9.0 is not installed (CI)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "peers"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def speculators():
    import peer_env

    if peer_env.speculators_version() is None:
        pytest.skip("speculators 0.9.0 is not installed (bench/peers/README.md)")


def test_the_peer_trains_on_our_samples_and_our_eval_reads_its_checkpoint(speculators, tiny_qwen3_dir, tmp_path):
    from dflash_train.model.drafter.export.ecosystem import load_drafter

    run = tmp_path / "run"
    cmd = [sys.executable, "bench/peers/peer_train.py", "--recipe", "tiny", f"target.model={tiny_qwen3_dir}",
           f"train.out_dir={run}", "data.max_samples=16", "drafter.num_taps=2", "topology.device=cpu",
           "eval.num_prompts=1", "eval.max_new_tokens=8", "eval.prompts=chitchat", "--max-steps", "3",
           "--num-workers", "0", "--log-every", "1", "--their", "total_seq_len=512", "--their", "max_anchors=16",
           "--their", "num_layers=1"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "peer_train: OK speculators dspark, 3 steps" in proc.stdout and "tau chitchat" in proc.stdout, out
    assert "teacher: speculators' verifier norm gives back our final hidden state within" in proc.stdout
    summary = json.loads((run / "peer-dspark" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["train_samples"] + summary["held_out_samples"] == 16
    assert summary["their_config"]["block_size"] == 8 and summary["their_config"]["loss_fn"] == "kl_div"
    loaded = load_drafter(run / "peer-dspark" / "checkpoint", num_target_layers=6)
    assert loaded.format == "speculators" and loaded.drafter.config.arch == "dspark"
    assert all(torch.isfinite(p).all() for p in loaded.drafter.parameters())
