"""The quickstart path, shortened: the real SmolLM2 target, real default prompts, regeneration
with taps, a few training steps, the z-lab export and real speculative decoding, end to end
through the console command (the README's first command runs the same with the default recipe)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_tiny_recipe_runs_end_to_end_on_smollm2(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "dflash_train", "train", "--recipe", "tiny", f"train.out_dir={out}"],
                          env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "dflash-train train: OK" in proc.stdout
    assert "regenerated and tapped" in output  # responses by the target, taps from the same pass
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 30
    assert config["dflash_config"]["target_layer_ids"] == [1, 8, 14, 20, 27]  # z-lab ids for 30 layers
    report = json.loads((out / "eval" / "report.json").read_text())
    assert set(report["sets"]) == {"assistant", "chitchat"}
    for figures in report["sets"].values():
        assert figures["tau"] >= 1.0 and figures["num_prompts"] == 2
    assert (out / "eval" / "acceptance_per_position.png").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in records) and any("eval" in r for r in records)
    assert "vllm serve" in proc.stdout and "--speculative-algorithm DFLASH" in proc.stdout
