"""Resume checks what the checkpoint was trained with: data, target, tokenizer, drafter, and the
fields that fix the global batch order; a change is refused with its name, or (data, target,
tokenizer, drafter) accepted knowingly with train.allow_changed and a warning."""

import copy

import pytest
import torch
from golden.loop_golden import golden_config
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train import recipes
from dflash_train.config import apply_overrides
from dflash_train.data.records import Sample
from dflash_train.train.loop import train
from dflash_train.train.provenance import Provenance, ProvenanceMismatch, data_fingerprint, tokenizer_fingerprint
from dflash_train.validate import config_problems

SAVED = {"data": {"num_samples": 80, "sha256": "aaaa"},
         "target": {"config_sha256": "c1", "weights_fingerprint": "w1"},
         "tokenizer": {"sha256": "k1"}, "drafter": {"sha256": "d1"},
         "order": {"train.seqs_per_step": 4, "train.seed": 0, "train.num_anchors": 64}}


def _changed(part, key, value):
    now = copy.deepcopy(SAVED)
    now[part][key] = value
    return now


@pytest.mark.parametrize("part,key,value", [("data", "sha256", "bbbb"), ("target", "weights_fingerprint", "w2"),
                                            ("tokenizer", "sha256", "k2"), ("drafter", "sha256", "d2")])
def test_each_changed_part_is_refused_by_name_and_allowed_knowingly(part, key, value):
    now = _changed(part, key, value)
    with pytest.raises(ProvenanceMismatch, match=rf"(?s){part}: {key}: .* -> .*train.allow_changed={part}"):
        Provenance(now, (), print).load_state_dict(SAVED)
    warnings = []
    Provenance(now, (part,), warnings.append).load_state_dict(SAVED)
    assert len(warnings) == 1 and f"WARNING resume: {part} changed" in warnings[0]
    Provenance(SAVED, (), warnings.append).load_state_dict(SAVED)  # nothing changed: silent
    assert len(warnings) == 1


def test_order_fields_and_the_sample_count_cannot_be_allowed():
    now = _changed("order", "train.seqs_per_step", 6)
    with pytest.raises(ProvenanceMismatch, match="(?s)train.seqs_per_step: 4 -> 6.*cannot change on resume"):
        Provenance(now, ("data", "target", "tokenizer", "drafter"), print).load_state_dict(SAVED)
    with pytest.raises(ProvenanceMismatch, match="the sample count cannot change"):
        Provenance(_changed("data", "num_samples", 81), ("data",), print).load_state_dict(SAVED)


def test_a_checkpoint_without_fingerprints_is_not_refused():
    provenance = Provenance(SAVED, (), print)
    provenance.load_state_dict({})  # an older checkpoint: nothing to compare, nothing refused
    assert provenance.checked


def test_data_and_tokenizer_fingerprints_see_content_changes(smollm2_tokenizer):
    samples = [Sample(str(i), (1, 2, 3 + i), (0, 1, 1)) for i in range(5)]
    base = data_fingerprint(samples)
    assert data_fingerprint(list(samples)) == base
    assert data_fingerprint(samples[:4] + [Sample("4", (1, 2, 8), (0, 1, 1))])["sha256"] != base["sha256"]
    assert data_fingerprint(samples[:4] + [Sample("4", (1, 2, 7), (0, 0, 1))])["sha256"] != base["sha256"]
    tok = tokenizer_fingerprint(smollm2_tokenizer)
    other = copy.deepcopy(smollm2_tokenizer)
    other.chat_template = "{{ messages }}"
    assert tokenizer_fingerprint(other) != tok


# --- real runs: train 2 steps, then resume with something changed ---------------------------



def _cfg(target, out, *extra):
    return golden_config(target, out, "train.max_steps=3", "train.ckpt_every=2", "train.eval_every=100",
                         "drafter.num_taps=3", *extra)


def test_resume_refuses_a_changed_target_drafter_or_batch_order_and_allows_a_target_knowingly(
        tiny_qwen3_dir, smollm2_tokenizer, tmp_path, contained, capsys):
    out = tmp_path / "run"
    contained.setenv("DFLASH_INJECT_FAULT", "raise:rank=0:step=3")
    with pytest.raises(RuntimeError, match="injected fault"):
        train(_cfg(tiny_qwen3_dir, out))
    contained.delenv("DFLASH_INJECT_FAULT")
    other = tmp_path / "other_target"
    other.mkdir()
    config = Qwen3Config.from_pretrained(tiny_qwen3_dir)
    torch.manual_seed(1)
    Qwen3ForCausalLM(config).save_pretrained(other)  # the same architecture, other weights
    smollm2_tokenizer.save_pretrained(other)
    with pytest.raises(ProvenanceMismatch, match=r"(?s)target: weights_fingerprint: .* -> .*train.allow_changed=target"):
        train(_cfg(other, out, "train.resume=true", f"target.model={other}"))
    with pytest.raises(ProvenanceMismatch, match=r"drafter: sha256"):
        train(_cfg(tiny_qwen3_dir, out, "train.resume=true", "drafter.num_layers=2"))
    with pytest.raises(ProvenanceMismatch, match=r"train.seqs_per_step: 4 -> 8"):
        train(_cfg(tiny_qwen3_dir, out, "train.resume=true", "train.seqs_per_step=8"))
    capsys.readouterr()
    result = train(_cfg(other, out, "train.resume=true", "train.allow_changed=target"))
    log = capsys.readouterr().out
    assert "WARNING resume: target changed since the checkpoint" in log and "resumed from" in log
    assert result["steps"] == 3


def test_config_names_an_unknown_allow_changed_part_and_a_zero_bad_step_limit():
    cfg = apply_overrides(recipes.get("tiny"), ["train.allow_changed=data,weights", "train.max_bad_steps=0"])
    problems = "\n".join(config_problems(cfg))
    assert "train.allow_changed=data,weights: ['weights'] not among data,target,tokenizer,drafter" in problems
    assert "train.max_bad_steps=0: must be >= 1" in problems
    assert not config_problems(apply_overrides(recipes.get("tiny"), ["train.allow_changed=data,target"]))
