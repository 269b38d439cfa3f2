"""`evaluate` and `dflash-train eval` end to end on a tiny random Qwen3 target that uses the real
SmolLM2 tokenizer and chat template (fixtures in tests/conftest.py), with tiny saved drafters."""

import json

import pytest
import torch

from dflash_train.cli import main
from dflash_train.eval.evaluate import eos_token_ids, evaluate, prompt_messages
from dflash_train.eval.report import HISTOGRAM_PNG, PER_POSITION_PNG
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.export.export import export_drafter
from dflash_train.model.drafter.export.draft_vocab import DRAFT_VOCAB, draft_vocab_file
from dflash_train.model.drafter.export.hf_format import save_zlab
from dflash_train.model.target.target import resolve_mask_token_id

PROMPTS = [
    {"conversations": [{"from": "human", "value": "Hi! How are you today?"}]},
    {"messages": [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "No."},
                  {"role": "user", "content": "Please, a short one."}, {"role": "assistant", "content": "OK"}]},
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
]


def _drafter(target_config, tokenizer, hidden=None, block_size=4) -> DFlashDrafter:
    mask = resolve_mask_token_id(tokenizer, target_config.vocab_size)
    cfg = drafter_config_from_target(target_config, num_layers=1, block_size=block_size, mask_token_id=mask,
                                     num_taps=2)
    if hidden is not None:  # a drafter for another (wider) target
        from dataclasses import replace

        cfg = replace(cfg, hidden_size=hidden)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    return drafter.eval()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "mine.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def test_prompt_messages_end_with_the_last_user_turn():
    msgs = PROMPTS[1]["messages"]
    assert prompt_messages(msgs) == msgs[:3]
    with pytest.raises(ValueError, match="user message"):
        prompt_messages([{"role": "system", "content": "x"}])


def test_evaluate_library_call(tiny_qwen3_target, tmp_path):
    t = tiny_qwen3_target
    assert t.tokenizer.convert_tokens_to_ids("<|im_end|>") in eos_token_ids(t.tokenizer, t.model)
    drafter = _drafter(t.config, t.tokenizer)
    sets = {"a": [m["messages"] for m in PROMPTS[1:]], "b": [[{"role": "user", "content": "Hello there"}]]}
    report = evaluate(drafter, t, sets, max_new_tokens=12, out_dir=tmp_path, progress=False)
    assert set(report["sets"]) == {"a", "b"} and report["block_size"] == 4
    for name, s in report["sets"].items():
        assert s["num_prompts"] == len(sets[name])
        assert s["steps"] == sum(s["accepted_length_histogram"]) > 0
        assert 1.0 <= s["tau"] <= 4.0 and len(s["per_position_acceptance"]) == 3
        assert 0 < s["spec_tokens"] <= 12 * s["num_prompts"] and s["speedup"] > 0
    assert report["overall"]["num_prompts"] == 3
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["overall"]["tau"] == pytest.approx(report["overall"]["tau"])
    assert (tmp_path / PER_POSITION_PNG).stat().st_size > 0 and (tmp_path / HISTOGRAM_PNG).stat().st_size > 0
    assert not drafter.training  # mode restored


def test_evaluate_rejects_a_drafter_for_another_target(tiny_qwen3_target):
    t = tiny_qwen3_target
    wrong = _drafter(t.config, t.tokenizer, hidden=96)
    with pytest.raises(ValueError, match="not compatible with target tiny-qwen3: hidden_size 96"):
        evaluate(wrong, t, {"a": [[{"role": "user", "content": "hi"}]]}, progress=False)


def test_cli_eval_end_to_end(tiny_qwen3_target, tiny_qwen3_dir, prompts_file, tmp_path, capsys):
    drafter_dir = save_zlab(_drafter(tiny_qwen3_target.config, tiny_qwen3_target.tokenizer), tmp_path / "drafter",
                            dtype=torch.float32)
    out = tmp_path / "out"
    rc = main(["eval", "--drafter", str(drafter_dir), "--target", str(tiny_qwen3_dir), "--prompts", str(prompts_file),
               "--num-prompts", "2", "--max-new-tokens", "10", "--out", str(out), "--device", "cpu",
               "--thinking", "off", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "dflash-train eval: OK tau=" in text and "speedup=" in text
    report = json.loads((out / "report.json").read_text())
    assert list(report["sets"]) == ["mine"] and report["sets"]["mine"]["num_prompts"] == 2
    # the train/serve check: training's simulated tau on the decoded text, in the report and the table
    assert 1.0 <= report["sets"]["mine"]["sim_tau"] <= 4.0 and "sim tau" in text
    assert report["thinking"] is False and report["max_new_tokens"] == 10
    assert (out / PER_POSITION_PNG).is_file() and (out / HISTOGRAM_PNG).is_file()
    assert report["draft_vocab"] is None and "draft vocabulary" not in text  # the directory has none


def _eval_each_mode(drafter_dir, target_dir, prompts_file, out, capsys) -> tuple[dict, dict]:
    """`dflash-train eval` of the drafter directory with eval.draft_vocab auto, full and subset: (reports, texts)."""
    args = ["eval", "--drafter", str(drafter_dir), "--target", str(target_dir), "--prompts", str(prompts_file),
            "--num-prompts", "2", "--max-new-tokens", "8", "--device", "cpu", "--thinking", "off", "--no-progress",
            "eval.dtype=target"]  # float32: identical outputs, not near-ties
    reports, texts = {}, {}
    for mode in ("auto", "full", "subset"):
        rc = main(args + ["--out", str(out / mode), "--draft-vocab", mode])
        texts[mode] = capsys.readouterr().out
        assert rc == 0, texts[mode]
        reports[mode] = json.loads((out / mode / "report.json").read_text())
        assert reports[mode]["sets"]["mine"]["identical_outputs"] == 2  # lossless either way (float32 greedy)
    return reports, texts


def _assert_beside_is_the_other_decode(reports, first: str, second: str) -> None:
    """auto's headline is the `first` mode's decode and its figures beside the `second` mode's."""
    auto = reports["auto"]["sets"]["mine"]
    assert auto["tau"] == reports[first]["sets"]["mine"]["tau"]
    assert auto["beside"]["tau"] == reports[second]["sets"]["mine"]["tau"]
    assert "beside" not in reports["subset"] and "beside" not in reports["full"]


def test_cli_eval_headline_is_the_draft_vocabulary_vllm_serves_with_the_whole_lm_head_beside(
        tiny_qwen3_target, tiny_qwen3_dir, prompts_file, tmp_path, capsys):
    """An export with a draft vocabulary in vLLM's reduced form (draft_vocab_size, lm_head, d2t): auto's headline
    drafts over it with the export's own rows, as vLLM serves it, and the whole lm_head, as SGLang serves it, is
    beside; full and subset measure one of the two, each naming its engine."""
    drafter_dir = export_drafter(_drafter(tiny_qwen3_target.config, tiny_qwen3_target.tokenizer), tmp_path / "drafter",
                                 str(tiny_qwen3_dir), dtype=torch.float32, draft_vocab=torch.arange(0, 200, 2),
                                 log=lambda m: None)
    assert not (drafter_dir / DRAFT_VOCAB).exists()  # the reduced form is the one record of it
    reports, texts = _eval_each_mode(drafter_dir, tiny_qwen3_dir, prompts_file, tmp_path, capsys)
    vllm, sglang = {"draft_vocab": 100, "served_by": ["vLLM"]}, {"draft_vocab": None, "served_by": ["SGLang"]}
    assert reports["auto"]["headline"].items() >= vllm.items() and reports["auto"]["draft_vocab"] == 100
    assert reports["auto"]["beside"].items() >= sglang.items()
    assert reports["full"]["headline"].items() >= sglang.items() and reports["full"]["draft_vocab"] is None
    assert reports["subset"]["headline"].items() >= vllm.items() and reports["subset"]["draft_vocab"] == 100
    _assert_beside_is_the_other_decode(reports, "subset", "full")
    assert ("the headline drafts over the 100-token draft vocabulary, as vLLM serves it; beside it, over the whole "
            "lm_head, as SGLang serves it") in texts["auto"]
    assert "over the whole lm_head, as SGLang serves it instead: tau" in texts["auto"]


def test_cli_eval_a_draft_vocab_json_no_engine_reads_is_beside_the_whole_lm_head(
        tiny_qwen3_target, tiny_qwen3_dir, prompts_file, tmp_path, capsys):
    """A directory whose draft vocabulary is draft_vocab.json (a checkpoint's drafter/, an export from before the
    reduced form): every engine drafts over the whole lm_head, auto's headline; the draft vocabulary is beside,
    named as served by no engine; a malformed file fails in validation, and full is the way round it."""
    drafter_dir = save_zlab(_drafter(tiny_qwen3_target.config, tiny_qwen3_target.tokenizer), tmp_path / "drafter",
                            dtype=torch.float32)
    (drafter_dir / DRAFT_VOCAB).write_text(json.dumps(draft_vocab_file(range(0, 200, 2))))
    reports, texts = _eval_each_mode(drafter_dir, tiny_qwen3_dir, prompts_file, tmp_path, capsys)
    assert reports["auto"]["headline"]["served_by"] == ["vLLM", "SGLang"] and reports["auto"]["draft_vocab"] is None
    assert reports["auto"]["beside"]["draft_vocab"] == 100 and reports["auto"]["beside"]["served_by"] == []
    assert reports["subset"]["draft_vocab"] == 100 and reports["full"]["draft_vocab"] is None
    _assert_beside_is_the_other_decode(reports, "full", "subset")
    assert "as no engine serves this directory (draft_vocab.json is read by no engine" in texts["auto"]
    args = ["eval", "--drafter", str(drafter_dir), "--target", str(tiny_qwen3_dir), "--prompts", str(prompts_file),
            "--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu", "--no-progress", "--out",
            str(tmp_path / "bad")]
    (drafter_dir / DRAFT_VOCAB).write_text('{"ids": [1, -3]}')  # fails in validation, before the target loads
    rc = main(args)
    text = capsys.readouterr().out
    assert rc == 2 and "draft_vocab.json: field 'ids' must list token ids" in text and "target: loading" not in text
    rc = main(args + ["--draft-vocab", "full"])  # the way round a bad file
    assert rc == 0, capsys.readouterr().out


def test_cli_eval_default_prompt_sets(tiny_qwen3_target, tiny_qwen3_dir, tmp_path, capsys):
    pytest.importorskip("dflash_train.data.corpus")
    drafter_dir = save_zlab(_drafter(tiny_qwen3_target.config, tiny_qwen3_target.tokenizer, block_size=3),
                            tmp_path / "drafter", dtype=torch.float32)
    # the same command spelled as config overrides (every flag is an alias of one)
    rc = main(["eval", f"eval.drafter={drafter_dir}", f"target.model={tiny_qwen3_dir}", "eval.num_prompts=1",
               "eval.max_new_tokens=6", "eval.temperature=0.7", f"eval.out_dir={tmp_path / 'out'}",
               "topology.device=cpu"])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report["sets"]) == {"assistant", "chitchat"} and report["block_size"] == 3
    assert report["temperature"] == 0.7


def test_cli_eval_fails_clearly(tiny_qwen3_target, tiny_qwen3_dir, tmp_path, capsys):
    wrong = save_zlab(_drafter(tiny_qwen3_target.config, tiny_qwen3_target.tokenizer, hidden=96), tmp_path / "d",
                      dtype=torch.float32)
    rc = main(["eval", "--drafter", str(wrong), "--target", str(tiny_qwen3_dir), "--out", str(tmp_path / "o"),
               "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "dflash-train eval: FAILED: drafter is not compatible with target" in text
    # a missing drafter directory fails in validation (exit 2), before the target is loaded
    rc = main(["eval", "--drafter", str(tmp_path / "missing"), "--target", str(tiny_qwen3_dir), "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 2 and f"dflash-train eval: FAILED: eval.drafter={tmp_path / 'missing'}: no config.json" in text
    assert "target: loading" not in text
    rc = main(["eval", "--target", str(tiny_qwen3_dir)])
    assert rc == 2 and "dflash-train eval: FAILED: eval.drafter is not set" in capsys.readouterr().out


def test_cli_eval_refuses_a_drafter_holding_a_nan_naming_the_tensor(tiny_qwen3_target, tiny_qwen3_dir, prompts_file,
                                                                    tmp_path, capsys):
    """Issue 39, defect 5: a drafter holding a NaN was evaluated and printed OK, tau 1.000."""
    drafter = _drafter(tiny_qwen3_target.config, tiny_qwen3_target.tokenizer)
    with torch.no_grad():
        drafter.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    drafter_dir = save_zlab(drafter, tmp_path / "drafter", dtype=torch.float32)
    rc = main(["eval", "--drafter", str(drafter_dir), "--target", str(tiny_qwen3_dir), "--prompts", str(prompts_file),
               "--num-prompts", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "out"), "--device", "cpu",
               "--no-progress"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("dflash-train eval: FAILED") and "layers.0.mlp.down_proj.weight" in last
    assert "1 NaN" in last and not (tmp_path / "out" / "report.json").exists()
