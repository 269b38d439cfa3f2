"""`check_drafter` / `dflash-train check`: each way an export would be served wrong fails with its
own field, and the default export passes. Real parts: the tiny random Qwen3 target saved as an HF
directory, a tiny drafter exported for it, the real SmolLM2 GGUF for the quantised case."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train import cli
from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.export.export import export_drafter
from dflash_train.model.drafter.export.hf_format import load_zlab, save_zlab
from dflash_train.model.drafter.export.check import ServingContractError, check_drafter
from dflash_train.model.drafter.export.serve import serve_instructions
from dflash_train.model.target.identity import describe_target
from tests.conftest import tiny_qwen3

MASK_ID = 3


def tiny_drafter(target_config, seed=0, **overrides) -> DFlashDrafter:
    cfg = drafter_config_from_target(target_config, num_layers=2, block_size=4, mask_token_id=MASK_ID, num_taps=2)
    drafter = DFlashDrafter(dataclasses.replace(cfg, **overrides))
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from one, so a mix-up of norm weights changes the output
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=gen)
    return drafter


@pytest.fixture(scope="module")
def target(tiny_qwen3_dir):
    return describe_target(str(tiny_qwen3_dir))


@pytest.fixture(scope="module")
def good_export(tiny_qwen3_target, tiny_qwen3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "drafter"
    return export_drafter(tiny_drafter(tiny_qwen3_target.config), out, str(tiny_qwen3_dir))


@pytest.fixture
def bad(good_export, tmp_path):
    """A copy of the good export to break: (dir, config dict, tensors, write())."""
    out = tmp_path / "bad"
    shutil.copytree(good_export, out)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))

    def write():
        (out / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(out / "model.safetensors"))
        return out

    return out, config, tensors, write


def fields(failures) -> set[str]:
    return {f.field for f in failures}


def test_the_default_export_passes_and_records_its_target(good_export, target):
    assert check_drafter(good_export, target) == []
    recorded = json.loads((good_export / "config.json").read_text())["dflash_config"]["trained_against"]
    assert recorded == target.provenance()
    assert recorded["num_layers"] == 6 and recorded["hidden_size"] == 64 and recorded["quantization"] is None
    assert load_zlab(good_export).config.extra["dflash_config"]["trained_against"] == recorded  # carried through


def test_a_renamed_key_fails(bad, target):
    out, _, tensors, write = bad
    tensors["layers.0.mlp.up.weight"] = tensors.pop("layers.0.mlp.up_proj.weight")
    failures = check_drafter(write(), target)
    assert fields(failures) == {"weights.missing", "weights.unexpected"}
    assert all("layers.0.mlp.up" in f.message for f in failures)


def test_a_model_prefix_fails(bad, target):
    out, _, tensors, write = bad
    for name in list(tensors):
        tensors["model." + name] = tensors.pop(name)
    failures = check_drafter(write(), target)
    assert fields(failures) == {"weights.prefix"} and "model." in failures[0].message


def test_shared_embeddings_fail(bad, target):
    out, _, tensors, write = bad
    tensors["lm_head.weight"] = torch.zeros(7, 64, dtype=torch.bfloat16)
    assert fields(check_drafter(write(), target)) == {"weights.shared"}


def test_a_wrong_vocab_fails(bad, target):
    out, config, _, write = bad
    config["vocab_size"] = target.vocab_size + 64
    failures = check_drafter(write(), target)
    assert fields(failures) == {"vocab_size"} and str(target.vocab_size) in failures[0].message


def test_a_mask_token_outside_the_table_fails(bad, target):
    out, config, _, write = bad
    config["dflash_config"]["mask_token_id"] = target.vocab_size
    assert "dflash_config.mask_token_id" in fields(check_drafter(write(), target))


def test_a_last_layer_tap_is_refused_when_derived_and_fails_the_check(tiny_qwen3_target, target, tmp_path):
    with pytest.raises(ValueError, match="last layer 5.*final norm.*vLLM.*SGLang"):
        drafter_config_from_target(tiny_qwen3_target.config, num_layers=2, block_size=4, mask_token_id=MASK_ID,
                                   target_layer_ids=[1, 5])
    drafter = tiny_drafter(tiny_qwen3_target.config, target_layer_ids=(1, 5))
    failures = check_drafter(save_zlab(drafter, tmp_path / "d"), target)
    assert fields(failures) == {"dflash_config.target_layer_ids"}
    assert "last layer 5" in failures[0].message and "SGLang never captures it" in failures[0].message
    with pytest.raises(ValueError, match="last layer"):
        drafter.config.check_target(target.hidden_size, target.num_layers, target.vocab_size)


def test_repeated_derived_taps_are_refused(tiny_qwen3_target):
    """z-lab's formula repeats ids when L - 3 < num_taps; the engines capture a layer once."""
    with pytest.raises(ValueError, match=r"\[1, 2, 2, 2, 3\] are not strictly increasing.*3 distinct"):
        drafter_config_from_target(tiny_qwen3_target.config, num_layers=1, block_size=4, mask_token_id=MASK_ID)


def test_unordered_layer_ids_and_a_tap_count_fc_does_not_take_fail(bad, target):
    out, config, _, write = bad
    config["dflash_config"]["target_layer_ids"] = [3, 1, 2]
    failures = [f for f in check_drafter(write(), target) if f.field == "dflash_config.target_layer_ids"]
    assert any("strictly increasing" in f.message for f in failures)
    assert any("fc.weight" in f.message and "takes 2 taps" in f.message for f in failures)


def test_a_mismatched_block_size_fails(bad, target):
    out, config, _, write = bad
    config["dflash_config"]["block_size"] = 8
    failures = check_drafter(write(), target)
    assert fields(failures) == {"block_size"} and "dflash_config.block_size" in failures[0].message


def test_a_block_size_other_than_training_fails_at_export(tiny_qwen3_target, good_export, target):
    trained = tiny_drafter(tiny_qwen3_target.config, block_size=8)
    failures = check_drafter(good_export, target, trained=trained)
    assert "training.block_size" in fields(failures)


def test_a_missing_head_dim_fails(bad, target):
    """Qwen3Config's default head_dim (128) is not the trainer's hidden/heads (16)."""
    out, config, _, write = bad
    del config["head_dim"]
    failures = check_drafter(write(), target)
    assert fields(failures) == {"head_dim"} and "default" in failures[0].message


def test_a_rope_theta_the_engines_read_otherwise_fails(bad, target):
    out, config, _, write = bad
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10.0}
    assert "rope_theta" in fields(check_drafter(write(), target))


def test_a_causal_full_attention_drafter_is_refused_by_name(bad, target):
    """`is_causal: true` makes vLLM run full-attention layers causally, which no DFlash drafter
    trains: the check names the key (it used to pass unread until the forward differed)."""
    out, config, _, write = bad
    config["is_causal"] = True
    failures = check_drafter(write(), target)
    assert fields(failures) == {"config"} and "is_causal" in failures[0].message


def test_a_wrong_target_fails(good_export, tiny_qwen3_target, tmp_path):
    same_shape = tmp_path / "other_seed"
    tiny_qwen3(tiny_qwen3_target.vocab_size, seed=1).save_pretrained(same_shape)
    failures = check_drafter(good_export, describe_target(str(same_shape)))
    assert fields(failures) == {"target.weights"} and str(same_shape) in failures[0].message
    deeper = tmp_path / "deeper"
    tiny_qwen3(tiny_qwen3_target.vocab_size, layers=8).save_pretrained(deeper)
    failures = check_drafter(good_export, describe_target(str(deeper)))
    assert {"num_target_layers", "target.config", "target.weights"} <= fields(failures)


def test_export_fails_loudly_for_a_drafter_that_does_not_fit_its_target(tiny_qwen3_target, tmp_path):
    narrow = tiny_qwen3(tiny_qwen3_target.vocab_size, hidden=32)
    narrow.save_pretrained(tmp_path / "narrow")
    with pytest.raises(ServingContractError) as info:
        export_drafter(tiny_drafter(tiny_qwen3_target.config), tmp_path / "d", str(tmp_path / "narrow"))
    assert fields(info.value.failures) == {"hidden_size"}
    assert "hidden_size: 64 but the target" in str(info.value)


def test_check_command_collects_all_failures_then_a_verdict(bad, tiny_qwen3_dir, capsys):
    out, config, tensors, write = bad
    config["dflash_config"]["block_size"] = 8
    tensors["model.fc.weight"] = tensors.pop("fc.weight")
    assert cli.main(["check", str(write()), "--target", str(tiny_qwen3_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("check: FAIL block_size:") for line in lines)
    assert any(line.startswith("check: FAIL weights.prefix:") for line in lines)
    assert lines[-1].startswith("dflash-train check: FAILED:") and "block_size" in lines[-1]


def test_check_command_passes_and_prints_serve_commands(good_export, tiny_qwen3_dir, capsys):
    assert cli.main(["check", str(good_export), "--target", str(tiny_qwen3_dir)]) == 0
    output = capsys.readouterr().out
    assert f"vllm serve {tiny_qwen3_dir} " in output and '"num_speculative_tokens": 3' in output
    assert output.splitlines()[-1].startswith("dflash-train check: OK")
    assert "check: vLLM 0.34.0: loads it as trained" in output and "check: SGLang 0.5.23: loads it as trained" in output


def test_export_command_records_the_target_and_checks(good_export, tiny_qwen3_dir, tmp_path, capsys):
    out = tmp_path / "re-exported"
    assert cli.main(["export", "--drafter", str(good_export), "--out", str(out), "--target", str(tiny_qwen3_dir)]) == 0
    assert "passes the serving check" in capsys.readouterr().out
    recorded = json.loads((out / "config.json").read_text())["dflash_config"]["trained_against"]
    assert recorded["path"] == str(tiny_qwen3_dir)


def test_a_gguf_trained_drafter_is_served_with_the_converted_dir(tiny_qwen3_target, tmp_path):
    smollm2 = describe_target("smollm2")
    assert smollm2.quantization == "gguf Q4_1" and smollm2.num_layers == 30 and smollm2.hidden_size == 576
    out = save_zlab(tiny_drafter(tiny_qwen3_target.config), tmp_path / "d", trained_against=smollm2.provenance())
    text = serve_instructions(out)
    assert f"vllm serve {smollm2.serve} " in text and f"--model-path {smollm2.serve} " in text
    assert '"num_speculative_tokens": 3' in text and "--speculative-num-draft-tokens 4" in text
    assert "gguf Q4_1" in text and "converted HF directory" in text


@pytest.mark.parametrize("causal", [False, True])
def test_a_windowed_drafter_exports_what_it_trained_and_the_check_sees_a_lost_causality_key(
        tiny_qwen3_target, tiny_qwen3_dir, target, tmp_path, causal):
    """A sliding-window drafter (window 3 < the check's 5 context positions + block 4, so the window
    binds) exports its causality as the engines read it, and passes; a non-causal one whose
    `is_causal`/`causal` keys are dropped is what an engine would run causally: the forward fails."""
    drafter = tiny_drafter(tiny_qwen3_target.config, layer_types=("sliding_attention",) * 2, sliding_window=4,
                           window_causal=causal)
    out = export_drafter(drafter, tmp_path / "drafter", str(tiny_qwen3_dir))
    config = json.loads((out / "config.json").read_text())
    assert ("is_causal" in config) is (not causal) and config["dflash_config"].get("causal", True) is causal
    assert check_drafter(out, target, trained=drafter) == []
    if not causal:
        config.pop("is_causal")
        config["dflash_config"].pop("causal")
        (out / "config.json").write_text(json.dumps(config))
        failures = check_drafter(out, target, trained=drafter)
        assert "training.window_causal" in fields(failures)


@pytest.fixture(scope="module")
def gemma3_dir(smollm2_tokenizer, tmp_path_factory):
    """A tiny random Gemma 3 (embeddings scaled by sqrt(64) = 8) of the tiny Qwen3's shape, as an HF dir."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=len(smollm2_tokenizer), sliding_window=16)
    out = tmp_path_factory.mktemp("gemma3")
    Gemma3ForCausalLM(cfg).save_pretrained(out)
    smollm2_tokenizer.save_pretrained(out)
    return out


def test_a_scaled_targets_fields_are_checked_against_the_target(gemma3_dir, tiny_qwen3_dir, tmp_path, capsys):
    """The Gemma drafter's dflash_config.input_embedding_scale must be the target's own scale: it passes
    against the Gemma target, fails (naming the field) against an unscaled one of the same shape and when
    the field is dropped, and a value no engine can apply fails; `check` notes which engines ignore it."""
    from transformers import AutoConfig

    gemma = describe_target(str(gemma3_dir))
    drafter = tiny_drafter(AutoConfig.from_pretrained(gemma3_dir))
    assert drafter.config.input_embedding_scale == 8.0
    out = export_drafter(drafter, tmp_path / "gemma-drafter", str(gemma3_dir))
    assert check_drafter(out, gemma) == []
    unrecorded = save_zlab(drafter, tmp_path / "unrecorded")
    failures = check_drafter(unrecorded, describe_target(str(tiny_qwen3_dir)))
    assert fields(failures) == {"dflash_config.input_embedding_scale"}
    assert "8.0 but the target" in failures[0].message and "scales its input embeddings by 1.0" in failures[0].message
    config = json.loads((unrecorded / "config.json").read_text())
    del config["dflash_config"]["input_embedding_scale"]
    (unrecorded / "config.json").write_text(json.dumps(config))
    assert fields(check_drafter(unrecorded, gemma)) == {"dflash_config.input_embedding_scale"}
    config["dflash_config"]["output_multiplier"] = 0
    (unrecorded / "config.json").write_text(json.dumps(config))
    failures = check_drafter(unrecorded, gemma)
    assert "dflash_config.output_multiplier" in fields(failures)
    assert any("no engine can apply it" in f.message for f in failures)
    assert cli.main(["check", str(out), "--target", str(gemma3_dir)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check: note:")]
    assert len(notes) == 1 and "dflash_config.input_embedding_scale=8.0" in notes[0] and "vLLM" in notes[0]


def test_a_top_level_scale_is_read_as_the_engines_read_it_and_checked_against_the_target(bad, target):
    """z-lab's dflash falls back to a top-level input_embedding_scale; the trainer reads it the same way (the
    forward, run on scaled block embeddings on both sides, agrees), and it is not the target's 1.0."""
    out, config, _, write = bad
    config["input_embedding_scale"] = 2.0
    assert load_zlab(write()).config.input_embedding_scale == 2.0
    failures = check_drafter(out, target)
    assert fields(failures) == {"dflash_config.input_embedding_scale"}


@pytest.mark.parametrize("arch,drop,field", [("dflash2", "selector_top_k", "dflash_config.selector_top_k"),
                                             ("dspark", "markov_rank", "markov_rank")])
def test_dflash2_and_dspark_exports_pass_and_a_missing_engine_key_is_named(tiny_qwen3_target, tiny_qwen3_dir,
                                                                          target, tmp_path, arch, drop, field):
    """Each architecture's export passes the whole check (its forward through the engines' view, DFlash
    2's convolutions included); dropping a key an engine needs where it reads it fails by name."""
    cfg = drafter_config_from_target(tiny_qwen3_target.config, num_layers=2, block_size=4, mask_token_id=MASK_ID,
                                     num_taps=2, arch=arch)
    drafter = build_drafter(dataclasses.replace(cfg, selector_rank=8, selector_top_k=4, markov_rank=8))
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # convolutions off the identity, so the engines' view must apply them
        for name, p in drafter.named_parameters():
            if "conv" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    out = export_drafter(drafter, tmp_path / arch, str(tiny_qwen3_dir))
    assert check_drafter(out, target, trained=drafter) == []
    config = json.loads((out / "config.json").read_text())
    (config["dflash_config"] if field.startswith("dflash_config") else config).pop(drop)
    (out / "config.json").write_text(json.dumps(config))
    assert field in fields(check_drafter(out, target))
    assert ("DSPARK" if arch == "dspark" else "DFLASH") in serve_instructions(out)


def test_pitfall_4_a_partial_rotary_target_trains_and_exports_the_rotation_it_is_served_with(tmp_path):
    """Published pitfall 4 (speculators #613/#733): a target with partial_rotary_factor 0.25. The
    drafter rotates the whole head in training (`rope_cos_sin` width = head_dim), its export declares
    no partial factor, and the engines' rotary embedding built from the saved config rotates exactly
    that many dimensions; a factor copied into the export is a named failure."""
    from transformers import Qwen3Config

    from dflash_train.model.drafter.backbone import rope_cos_sin
    from dflash_train.model.drafter.export.engine_view import engine_config
    from dflash_train.model.drafter.export.check import engine_rotary_dim

    partial = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=97, partial_rotary_factor=0.25)
    cfg = drafter_config_from_target(partial, num_layers=1, block_size=4, mask_token_id=MASK_ID, num_taps=2)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    out = save_zlab(drafter, tmp_path / "d", dtype=torch.float32)
    trained = rope_cos_sin(torch.arange(3)[None], cfg.head_dim, cfg.rope_theta)[0].shape[-1]
    assert trained == engine_rotary_dim(engine_config(out)) == 16
    assert check_drafter(out, None, trained=drafter) == []
    config = json.loads((out / "config.json").read_text())
    config["partial_rotary_factor"] = 0.25  # the bug: the target's factor copied into the drafter
    (out / "config.json").write_text(json.dumps(config))
    failures = check_drafter(out, None)
    assert "partial_rotary_factor" in fields(failures) and "4 of each head's 16" in str(failures)


def test_dspark_keys_inside_dflash_config_are_what_vllm_refuses(tiny_qwen3_target, tiny_qwen3_dir, target, tmp_path):
    """vLLM 0.34's DSpark speculator runs its DFlash base first, which raises when
    `dflash_config.sample_from_anchor` is truthy (v1/worker/gpu/spec_decode/dflash/speculator.py); its
    DSpark model reads the DSpark keys at the top level only (models/qwen3_dspark.py), as SGLang's does
    (models/dspark.py). The export writes them there; the old placement (all inside dflash_config) is
    named key by key with the engines that refuse it."""
    cfg = drafter_config_from_target(tiny_qwen3_target.config, num_layers=2, block_size=4, mask_token_id=MASK_ID,
                                     num_taps=2, arch="dspark")
    drafter = build_drafter(dataclasses.replace(cfg, markov_rank=8))
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    out = export_drafter(drafter, tmp_path / "ds", str(tiny_qwen3_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["sample_from_anchor"] is True and "sample_from_anchor" not in config["dflash_config"]
    assert check_drafter(out, target, trained=drafter) == []
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "sample_from_anchor"):  # the old placement
        config["dflash_config"][key] = config.pop(key)
    (out / "config.json").write_text(json.dumps(config))
    failures = {f.field: f for f in check_drafter(out, target, trained=drafter)}
    assert failures["dflash_config.sample_from_anchor"].refused_by == ("vLLM",)
    assert set(failures["markov_rank"].refused_by) == {"vLLM", "SGLang"}
    assert failures["markov_head_type"].refused_by == ("SGLang",)
    assert "enable_confidence_head" in failures and "vLLM" in failures["enable_confidence_head"].message


def test_a_float16_tensor_in_a_bfloat16_export_fails_by_name(bad, target):
    """Issue 39: `check` passed a float16 tensor in a bfloat16 export (both engines cast it into a
    bfloat16 parameter without a word: vLLM model_loader/weight_utils.py default_weight_loader)."""
    out, config, tensors, write = bad
    assert config["dtype"] == "bfloat16"
    tensors["layers.1.mlp.up_proj.weight"] = tensors["layers.1.mlp.up_proj.weight"].to(torch.float16)
    failures = check_drafter(write(), target)
    assert fields(failures) == {"weights.dtype"}
    assert "layers.1.mlp.up_proj.weight is float16" in str(failures) and "bfloat16" in str(failures)


def test_a_nan_in_an_export_fails_by_name(bad, target):
    out, config, tensors, write = bad
    tensors["norm.weight"][3] = float("nan")
    failures = check_drafter(write(), target)
    assert fields(failures) == {"weights.non_finite"} and "norm.weight" in str(failures)


def test_check_command_says_which_engine_refuses_what(bad, tiny_qwen3_dir, capsys):
    out, config, tensors, write = bad
    config["dflash_config"]["sample_from_anchor"] = True  # refused by vLLM's DFlash speculator only
    assert cli.main(["check", str(write()), "--target", str(tiny_qwen3_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("check: FAIL dflash_config.sample_from_anchor:") for line in lines)
    assert "check: vLLM 0.34.0: would refuse to load it (dflash_config.sample_from_anchor)" in lines
    assert "check: SGLang 0.5.23: would load it and serve it wrong (see the failures above)" in lines
