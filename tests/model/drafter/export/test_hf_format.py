import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.export.draft_vocab import DRAFT_VOCAB, draft_vocab_file, load_draft_vocab
from dflash_train.model.drafter.export.hf_format import load_zlab, save_speculators, save_zlab, zlab_config_dict
from dflash_train.model.drafter.export.export import export_drafter

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)


def qwen3_8b_drafter_config():
    return drafter_config_from_target(Qwen3Config(**QWEN3_8B), num_layers=5, block_size=16, mask_token_id=151669)


def test_qwen3_8b_config_and_tensor_names_match_the_published_drafter():
    cfg = qwen3_8b_drafter_config()
    d = zlab_config_dict(cfg)
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["block_size"] == 16 and d["dflash_config"]["block_size"] == 16
    assert d["num_target_layers"] == 36
    assert d["dflash_config"]["mask_token_id"] == 151669
    assert d["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert (d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]) == (4096, 12288, 5)
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == (32, 8, 128)
    assert d["rope_theta"] == 1e6 and d["tie_word_embeddings"] is False and d["vocab_size"] == 151936
    assert "partial_rotary_factor" not in d and d["rope_scaling"] is None
    with torch.device("meta"):  # no allocation: ~1B parameters
        drafter = DFlashDrafter(cfg)
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert shapes["hidden_norm.weight"] == (4096,) and shapes["norm.weight"] == (4096,)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["layers.4.self_attn.q_norm.weight"] == (128,)
    assert shapes["layers.4.mlp.down_proj.weight"] == (4096, 12288)
    per_layer = {k.split(".", 2)[2] for k in shapes if k.startswith("layers.0.")}
    assert per_layer == {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {"self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert not any("embed" in k or "lm_head" in k for k in shapes)
    n_params = sum(v.numel() for v in drafter.state_dict().values())
    assert abs(n_params / 1e9 - 1.05) < 0.01  # spec 1.2: about 1.05B trainable parameters


def small_drafter(seed=0):
    cfg = drafter_config_from_target(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                 vocab_size=50), num_layers=2, block_size=8, mask_token_id=49,
                                     num_taps=2)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(seed))
    return drafter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_then_load_round_trips_bit_exactly(tmp_path, dtype):
    drafter = small_drafter().to(dtype)
    out = save_zlab(drafter, tmp_path / "ckpt", dtype=dtype)
    loaded = load_zlab(out)
    assert loaded.config == drafter.config
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b)
    assert not list(tmp_path.glob(".ckpt.tmp-*"))  # temp dir renamed into place
    names = set(load_file(str(out / "model.safetensors")))
    assert names == set(drafter.state_dict())


def test_loads_a_published_style_directory(tmp_path):
    """Older z-lab checkpoints: block_size only at the top level, no dflash_config.block_size,
    `model.` weight prefix."""
    drafter = small_drafter(seed=1)
    d = zlab_config_dict(drafter.config)
    del d["dflash_config"]["block_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    save_file({f"model.{k}": v for k, v in drafter.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = load_zlab(tmp_path)
    assert loaded.config.block_size == 8
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))


def test_missing_weights_are_named(tmp_path):
    drafter = small_drafter()
    (tmp_path / "config.json").write_text(json.dumps(zlab_config_dict(drafter.config)))
    state = drafter.state_dict()
    del state["fc.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        load_zlab(tmp_path)


def test_speculators_export_shifts_layer_ids(tmp_path):
    drafter = small_drafter()
    embed = torch.randn(50, 32)
    out = save_speculators(drafter, tmp_path / "spec", embed, embed, "some/target", ["LlamaForCausalLM"])
    d = json.loads((out / "config.json").read_text())
    assert d["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.config.target_layer_ids]
    assert d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    names = set(load_file(str(out / "model.safetensors")))
    assert {"embed_tokens.weight", "lm_head.weight", "fc.weight"} <= names


def test_a_draft_vocab_json_still_loads_and_malformed_ones_are_named(tmp_path):
    """The kept form (draft_vocab.json): older exports, checkpoints' drafter/, and an export without its target's
    lm_head to copy the reduced form's rows from (said); read as before (the reduced form: test_draft_vocab.py)."""
    drafter = small_drafter()
    ids = torch.tensor([0, 3, 7, 49])
    said = []
    out = export_drafter(drafter, tmp_path / "d", draft_vocab=ids, log=said.append)
    assert any("WARNING: the 4-token draft vocabulary stays in draft_vocab.json" in line for line in said)
    assert torch.equal(load_draft_vocab(out, 50), ids)
    assert load_zlab(out).config == drafter.config  # JSON beside the weights: the loader reads *.safetensors
    assert load_draft_vocab(export_drafter(drafter, tmp_path / "plain", log=lambda m: None), 50) is None
    with pytest.raises(ValueError, match=r"draft_vocab.json: field 'ids' must list token ids in \[0, 40\)"):
        load_draft_vocab(out, 40)  # 49 is no token of a 40-token vocabulary
    (out / DRAFT_VOCAB).write_text('{"tokens": [1]}')
    with pytest.raises(ValueError, match="draft_vocab.json: expected a JSON object with an 'ids' list"):
        load_draft_vocab(out, 50)
    for content, message in (('{"ids": 5}', "must be a list of token ids, not int"),
                             ('{"ids": [1, true]}', r"bad entries: \[True\]")):
        (out / DRAFT_VOCAB).write_text(content)
        with pytest.raises(ValueError, match=message):
            load_draft_vocab(out, 50)
    (out / DRAFT_VOCAB).write_text(json.dumps(draft_vocab_file(range(50))))
    assert load_draft_vocab(out, 50) is None  # every token: drafting over it is the plain head


def test_a_targets_scaling_is_written_where_not_the_identity_and_read_back(tmp_path):
    """dflash_config carries input_embedding_scale, output_multiplier and final_logit_softcapping only when
    they are not the identity (so an unscaled target's export is unchanged), and reads them back, from
    dflash_config or, as z-lab's dflash falls back, the top level; the speculators format, which has no
    field for them, refuses such a drafter."""
    import dataclasses

    plain = small_drafter()
    plain_dict = zlab_config_dict(plain.config)
    assert not {"input_embedding_scale", "output_multiplier", "final_logit_softcapping"} & (
        set(plain_dict["dflash_config"]) | set(plain_dict))
    cfg = dataclasses.replace(plain.config, input_embedding_scale=25.298221281347036, output_multiplier=0.125,
                              final_logit_softcapping=30.0)
    scaled = DFlashDrafter(cfg)
    scaled.load_state_dict(plain.state_dict())
    out = save_zlab(scaled, tmp_path / "scaled")
    written = json.loads((out / "config.json").read_text())
    assert {k: written["dflash_config"][k] for k in ("input_embedding_scale", "output_multiplier",
                                                      "final_logit_softcapping")} == {
        "input_embedding_scale": 25.298221281347036, "output_multiplier": 0.125, "final_logit_softcapping": 30.0}
    assert load_zlab(out).config == cfg
    top_level = dict(written)
    top_level["final_logit_softcapping"] = top_level["dflash_config"].pop("final_logit_softcapping")
    (out / "config.json").write_text(json.dumps(top_level))
    assert load_zlab(out).config.final_logit_softcapping == 30.0
    with pytest.raises(ValueError, match="speculators.*dflash_config.input_embedding_scale=25.29"):
        save_speculators(scaled, tmp_path / "spec", torch.randn(50, 32), torch.randn(50, 32), "t", ["X"])
    with pytest.raises(ValueError, match="output_multiplier: -1.0 is not a finite number > 0"):
        dataclasses.replace(cfg, output_multiplier=-1.0)
