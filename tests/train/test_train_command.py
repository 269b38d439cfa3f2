"""The serving commands printed at the end of `dflash-train train` name the target the drafter was
trained against (as recorded in its export) and num_speculative_tokens = block_size - 1."""

import json

from dflash_train.train.command import summary


def test_summary_serves_the_recorded_training_target(tmp_path):
    export = tmp_path / "drafter"
    export.mkdir()
    recorded = {"name": "m.gguf", "quantization": "gguf Q4_1", "serve": "/cache/m-converted"}
    (export / "config.json").write_text(json.dumps({"block_size": 16, "dflash_config": {
        "block_size": 16, "trained_against": recorded}}))
    result = {"steps": 1, "total_steps": 1, "tokens": 10, "sim": {"sim_tau": 1.5}, "export": str(export)}
    text = summary(result)
    assert "vllm serve /cache/m-converted " in text and '"num_speculative_tokens": 15' in text
    assert "--model-path /cache/m-converted " in text and "--speculative-num-draft-tokens 16" in text
    assert "gguf Q4_1" in text
