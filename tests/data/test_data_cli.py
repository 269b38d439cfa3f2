"""`dflash-train regenerate` then `dflash-train prepare` end to end on a tiny target dir,
with their verdict lines and exit codes."""

from __future__ import annotations

import json

from dflash_train.cli import main


def test_regenerate_then_prepare(tmp_path, tiny_qwen3_dir, capsys):
    data = tmp_path / "in.jsonl"
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"Say something about {i}."}]}
            for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    out = tmp_path / "regen.jsonl"
    args = ["regenerate", "--target", str(tiny_qwen3_dir), "--data", str(data), "--out", str(out),
            "--max-new-tokens", "5", "--batch-size", "2", "--device", "cpu"]
    assert main(args) == 1
    assert "dflash-train regenerate: FAILED: in.jsonl:6: bad JSON" in capsys.readouterr().out
    assert main(args + ["--skip-bad-rows"]) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("dflash-train regenerate: OK 5 new + 0 already done = 5 rows") and "1 bad rows" in verdict
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [f"r{i}" for i in range(5)]

    shards = tmp_path / "shards"
    assert main(["prepare", "--target", str(tiny_qwen3_dir), "--data", str(out), "--out", str(shards),
                 "--format", "fp8", "--layer-ids", "1,4", "--device", "cpu", "--min-loss-tokens", "1"]) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("dflash-train prepare: OK 5 samples")
    index = json.loads((shards / "index.json").read_text())
    assert index["layer_ids"] == [1, 4] and index["dtype"] == "fp8" and index["complete"]

    assert main(["prepare", "--target", str(tiny_qwen3_dir), "--data", str(data), "--skip-bad-rows",
                 "--out", str(tmp_path / "none"), "--device", "cpu"]) == 1
    assert "regenerate` first" in capsys.readouterr().out
    # prompt-only `default` data is refused in validation, before the target loads
    assert main(["prepare", f"target.model={tiny_qwen3_dir}", f"data.shards={tmp_path / 'none'}"]) == 2
    text = capsys.readouterr().out
    assert "dflash-train prepare: FAILED: data.train=default holds prompts only" in text and "target:" not in text


def test_regenerate_and_prepare_need_their_outputs(capsys):
    assert main(["regenerate"]) == 2
    assert "dflash-train regenerate: FAILED: data.regen_out is not set" in capsys.readouterr().out
    assert main(["prepare", "--data", "chitchat"]) == 2
    assert "dflash-train prepare: FAILED: data.shards is not set" in capsys.readouterr().out
