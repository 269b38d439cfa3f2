"""Resume checks what the checkpoint was trained with: data, target, tokenizer, drafter, and the
fields that fix the global batch order; a change is refused with its name, or (data, target,
tokenizer, drafter) accepted knowingly with train.allow_changed and a warning."""

import copy
import json

import pytest
import torch
from golden.loop_golden import golden_config
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train import recipes
from dflash_train.overrides import apply_overrides
from dflash_train.data.records import Sample
from dflash_train.train.loop import train
from dflash_train.train.state.provenance import (Provenance, ProvenanceMismatch, data_fingerprint, fingerprints,
                                                 tokenizer_fingerprint)
from dflash_train.validate import config_problems

SAVED = {"data": {"num_samples": 80, "sha256": "aaaa"},
         "target": {"config_sha256": "c1", "weights_fingerprint": "w1"},
         "tokenizer": {"sha256": "k1"}, "drafter": {"num_layers": 2},
         "order": {"train.seqs_per_step": 4, "train.seed": 0, "train.num_anchors": 64}}


def _changed(part, key, value):
    now = copy.deepcopy(SAVED)
    now[part][key] = value
    return now


@pytest.mark.parametrize("part,key,value", [("data", "sha256", "bbbb"), ("target", "weights_fingerprint", "w2"),
                                            ("tokenizer", "sha256", "k2"), ("drafter", "num_layers", 3)])
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


def test_a_drafter_setting_added_since_the_checkpoint_compares_as_its_default():
    """A checkpoint written before a head setting existed does not record it: it resumes while the setting
    keeps its default, and is refused, naming it, when it does not."""
    from dflash_train.train.state.provenance import UNRECORDED

    name, default = next((k, v) for k, v in UNRECORDED["drafter"].items() if isinstance(v, int)
                         and not isinstance(v, bool))
    now = _changed("drafter", name, default)
    Provenance(now, (), print).load_state_dict(SAVED)  # not recorded then, at its default now: no change
    with pytest.raises(ProvenanceMismatch, match=rf"(?s)drafter: {name}: {default} -> {default + 1}"):
        Provenance(_changed("drafter", name, default + 1), (), print).load_state_dict(SAVED)


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
    with pytest.raises(ProvenanceMismatch, match=r"(?s)target: weights_sha256: .* -> .*train.allow_changed=target"):
        train(_cfg(other, out, "train.resume=true", f"target.model={other}"))
    with pytest.raises(ProvenanceMismatch, match=r"drafter: .*num_layers: 1 -> 2"):
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


# --- identity that cannot be fooled (issue 32, defects 3, 4 and 6) --------------------------------

def _nudged_copy(src, dst, name="model.layers.2.mlp.down_proj.weight", delta=1e-3):
    """A copy of the target dir with one weight of one MLP matrix nudged: same size, same header."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = next(dst.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors[name].view(-1)[tensors[name].numel() // 2] += delta
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == next(src.glob("*.safetensors")).stat().st_size
    return dst


def _target_cfg(model):
    return apply_overrides(recipes.get("tiny"), [f"target.model={model}"])


def _drafter_cfg(num_layers=1):
    from dflash_train.model.drafter.config import drafter_config_from_target

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256)
    return drafter_config_from_target(config, num_layers=num_layers, block_size=4, mask_token_id=255, num_taps=3)


def test_a_target_with_one_weight_changed_is_another_target(tiny_qwen3_dir, tiny_qwen3_target, tmp_path):
    samples = [Sample("a", (1, 2, 3), (0, 1, 1))]
    other = _nudged_copy(tiny_qwen3_dir, tmp_path / "nudged")
    dcfg = _drafter_cfg()
    saved = fingerprints(_target_cfg(tiny_qwen3_dir), tiny_qwen3_target, dcfg, samples)
    now = fingerprints(_target_cfg(other), tiny_qwen3_target, dcfg, samples)
    assert now["target"] != saved["target"]
    with pytest.raises(ProvenanceMismatch, match=r"(?s)target: weights_sha256: .* -> .*train.allow_changed=target"):
        Provenance(now, (), print).load_state_dict(saved)
    copy_ = tmp_path / "copied"  # a byte-identical copy elsewhere is the same target
    import shutil

    shutil.copytree(tiny_qwen3_dir, copy_)
    assert fingerprints(_target_cfg(copy_), tiny_qwen3_target, dcfg, samples)["target"] == saved["target"]


def test_the_weights_are_hashed_once_per_file_version(tiny_qwen3_dir, tmp_path):
    from dflash_train import cache

    weights = next(tiny_qwen3_dir.glob("*.safetensors"))
    lines = []
    first = cache.file_sha256(weights, log=lines.append)
    again = cache.file_sha256(weights, log=lines.append)
    assert first == again and len(first) == 64
    assert sum("hashing" in line for line in lines) <= 1  # the second call reads the cached digest
    other = _nudged_copy(tiny_qwen3_dir, tmp_path / "nudged")
    assert cache.file_sha256(next(other.glob("*.safetensors"))) != first


def test_a_renamed_byte_identical_data_file_is_the_same_data(tmp_path, smollm2_tokenizer):
    from dflash_train.data.conversations import read_conversations, tokenize_conversations
    from dflash_train.data.dataset import split_held_out

    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer number {i}"}]} for i in range(30)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    first, renamed = tmp_path / "chat.jsonl", tmp_path / "chat-renamed.jsonl"
    first.write_text(text)
    renamed.write_text(text)

    def samples(path):
        conversations, _ = read_conversations(str(path))
        tokenized, _ = tokenize_conversations(smollm2_tokenizer, conversations, 128)
        return [Sample(s.id, tuple(s.input_ids), tuple(s.loss_mask)) for s in tokenized]

    a, b = samples(first), samples(renamed)
    assert [s.id for s in a] == [s.id for s in b]
    assert split_held_out(a, 0.3)[1][0] == split_held_out(b, 0.3)[1][0]  # the same held-out samples
    assert data_fingerprint(split_held_out(a, 0.3)[0][0]) == data_fingerprint(split_held_out(b, 0.3)[0][0])


def test_every_suggested_allow_changed_value_lets_the_resume_go_on():
    """A refusal suggests train.allow_changed only for parts it would let through; a changed sample
    count is refused without that suggestion, with what to do instead."""
    cases = [_changed(part, key, value) for part, key, value in
             [("data", "sha256", "bbbb"), ("target", "weights_fingerprint", "w2"), ("tokenizer", "sha256", "k2"),
              ("drafter", "num_layers", 3), ("data", "num_samples", 81)]]
    both = _changed("target", "weights_fingerprint", "w2")
    both["data"]["num_samples"] = 81
    for now in cases + [both]:
        with pytest.raises(ProvenanceMismatch) as refused:
            Provenance(now, (), print).load_state_dict(SAVED)
        message = str(refused.value)
        suggested = [line.split("train.allow_changed=")[1].split()[0].rstrip(";,")
                     for line in message.splitlines() if "train.allow_changed=" in line]
        if now["data"]["num_samples"] != SAVED["data"]["num_samples"]:
            assert "data.num_samples" in message or "num_samples: 80 -> 81" in message
            assert not any("data" in s.split(",") for s in suggested), message
            assert "new train.out_dir" in message
            continue
        assert suggested, message
        Provenance(now, tuple(suggested[0].split(",")), print).load_state_dict(SAVED)  # goes on


def test_a_changed_drafter_is_refused_naming_its_field(tiny_qwen3_dir, tiny_qwen3_target):
    samples = [Sample("a", (1, 2, 3), (0, 1, 1))]
    cfg = _target_cfg(tiny_qwen3_dir)
    saved = fingerprints(cfg, tiny_qwen3_target, _drafter_cfg(1), samples)
    now = fingerprints(cfg, tiny_qwen3_target, _drafter_cfg(2), samples)
    with pytest.raises(ProvenanceMismatch, match=r"drafter: num_layers: 1 -> 2") as refused:
        Provenance(now, (), print).load_state_dict(saved)
    assert "sha256" not in str(refused.value)


def test_an_architecture_change_is_refused_naming_the_weights_even_when_allowed(tiny_qwen3_dir, tiny_qwen3_target):
    """Issue 39: `train.allow_changed=drafter`, suggested after dflash -> dspark, crashed in
    load_state_dict. A drafter whose weights change is refused with the tensors named and no
    allow_changed suggestion; a change that keeps the weights (rope_theta) is suggested and goes on."""
    import dataclasses

    samples = [Sample("a", (1, 2, 3), (0, 1, 1))]
    cfg = _target_cfg(tiny_qwen3_dir)
    saved = fingerprints(cfg, tiny_qwen3_target, _drafter_cfg(), samples)
    dspark = fingerprints(cfg, tiny_qwen3_target, dataclasses.replace(_drafter_cfg(), arch="dspark"), samples)
    for allowed in ((), ("drafter",)):
        with pytest.raises(ProvenanceMismatch) as refused:
            Provenance(dspark, allowed, print).load_state_dict(saved)
        message = str(refused.value)
        assert "arch: 'dflash' -> 'dspark'" in message and "markov_head.markov_w1.weight" in message
        assert "to resume anyway" not in message and "cannot change on resume" not in message
    theta = fingerprints(cfg, tiny_qwen3_target, dataclasses.replace(_drafter_cfg(), rope_theta=5e5), samples)
    with pytest.raises(ProvenanceMismatch, match="to resume anyway, knowingly: train.allow_changed=drafter"):
        Provenance(theta, (), print).load_state_dict(saved)
    warnings = []
    Provenance(theta, ("drafter",), warnings.append).load_state_dict(saved)
    assert "WARNING resume: drafter changed" in warnings[0]
