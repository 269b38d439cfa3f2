"""`dflash-train eval` on drafters from the ecosystem: a speculators-format DSpark and a DeepSpec one are
measured like ours; a checkpoint our classes cannot run fails in validation, before the target loads."""

import dataclasses
import json

import torch

from dflash_train.cli import main
from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.target.target import resolve_mask_token_id
from tests.model.drafter.export.test_ecosystem import write_deepspec, write_speculators


def _dspark(target):
    mask = resolve_mask_token_id(target.tokenizer, target.config.vocab_size)
    cfg = drafter_config_from_target(target.config, num_layers=1, block_size=4, mask_token_id=mask, num_taps=2,
                                     arch="dspark", sliding_window=256)
    drafter = build_drafter(dataclasses.replace(cfg, markov_rank=8))
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    return drafter.eval()


def test_cli_eval_measures_speculators_and_deepspec_drafters(tiny_qwen3_target, tiny_qwen3_dir, tmp_path, capsys):
    drafter = _dspark(tiny_qwen3_target)
    for name, out in (("speculators", write_speculators(drafter, tmp_path / "spec")),
                      ("deepspec", write_deepspec(_full(drafter), tiny_qwen3_target.config, tmp_path / "ds"))):
        rc = main(["eval", "--drafter", str(out), "--target", str(tiny_qwen3_dir), "--prompts", "chitchat",
                   "--num-prompts", "1", "--max-new-tokens", "8", "--out", str(tmp_path / f"eval-{name}"),
                   "--device", "cpu", "--no-progress"])
        text = capsys.readouterr().out
        assert rc == 0, text
        assert f"({name} format, dspark)" in text and "dflash-train eval: OK tau=" in text
        report = json.loads((tmp_path / f"eval-{name}" / "report.json").read_text())
        assert report["drafted_per_step"] == 4 and report["sets"]["chitchat"]["num_prompts"] == 1


def _full(drafter):
    """The same drafter with full-attention layers (DeepSpec's DSpark has no sliding window)."""
    cfg = dataclasses.replace(drafter.config, layer_types=("full_attention",) * drafter.config.num_layers,
                              sliding_window=None)
    full = build_drafter(cfg)
    full.load_state_dict(drafter.state_dict())
    return full.eval()


def test_cli_eval_refuses_an_unsupported_checkpoint_before_loading_the_target(tiny_qwen3_target, tiny_qwen3_dir,
                                                                              tmp_path, capsys):
    out = write_speculators(_dspark(tiny_qwen3_target), tmp_path / "eagle", speculators_model_type="eagle3")
    rc = main(["eval", "--drafter", str(out), "--target", str(tiny_qwen3_dir), "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 2 and f"eval.drafter={out}: {out / 'config.json'}: speculators_model_type: 'eagle3'" in text
    assert "target: loading" not in text
