"""Drafters from the ecosystem (model/drafter/export/ecosystem.py): checkpoints in the speculators and DeepSeek DeepSpec
formats load into our classes with the same logits as the drafter that wrote them, and decode losslessly.

Written by speculators' own code where it is installed (it is not in CI: those tests skip), and otherwise
by writers that follow what each one writes (read from their code: speculators 0.9.0's save_pretrained,
DeepSpec's deepspec/modeling/dspark/qwen3/config.py and trainer/ckpt_manager.py)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_train.data.anchors import block_inputs, position_ids
from dflash_train.eval.spec_decode import speculative_generate, target_generate
from dflash_train.model.drafter.attention import SLIDING, MaskSpec, build_training_masks
from dflash_train.model.drafter.export.ecosystem import UnsupportedDrafter, config_problems, detect_format, load_drafter
from dflash_train.model.drafter.export.hf_format import save_zlab
from tests.model.drafter.heads.test_dflash2 import MASK, V, arch_drafter
from tests.model.drafter.test_backbone import tiny_target_config

SPECULATORS_CLASS = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}


def write_speculators(drafter, out: Path, **override) -> Path:
    """A checkpoint as speculators 0.9.0's `save_pretrained` writes it: the decoder as a Qwen3Config diff,
    taps as HF hidden_states indices, the heads' fields flat, the drafter's tensors under our names."""
    c = drafter.config
    layer = Qwen3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                        vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, layer_types=list(c.layer_types),
                        sliding_window=c.sliding_window, use_sliding_window=SLIDING in c.layer_types,
                        rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
                        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False)
    config = {"architectures": [SPECULATORS_CLASS[c.arch]], "speculators_model_type": c.arch,
              "transformer_layer_config": layer.to_diff_dict(), "draft_vocab_size": c.vocab_size,
              "block_size": c.block_size, "target_hidden_size": None,
              "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids], "mask_token_id": c.mask_token_id,
              "sliding_window_non_causal": not c.window_causal, "sample_from_anchor": c.arch == "dspark",
              "speculators_config": {"algorithm": c.arch, "default_proposal_method": "greedy",
                                     "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "v"}},
              "speculators_version": "0.9.0"}
    if c.arch == "dspark":
        config.update(markov_rank=c.markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
                      confidence_head_with_markov=True)
    if c.arch == "dflash2":
        config.update(conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size,
                      selector_rank=c.selector_rank, selector_top_k=c.selector_top_k)
    return _write(out, config, drafter, override)


def write_deepspec(drafter, target_config, out: Path, **override) -> Path:
    """A checkpoint as DeepSpec writes a DSpark: the target's config copied with the DSpark keys at the top
    level (`build_draft_config`), saved with the frozen embed_tokens and lm_head copies beside."""
    c = drafter.config
    config = target_config.to_dict()
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=target_config.num_hidden_layers,
                  num_hidden_layers=c.num_layers, block_size=c.block_size, tie_word_embeddings=False,
                  layer_types=["full_attention"] * c.num_layers, mask_token_id=c.mask_token_id,
                  target_layer_ids=list(c.target_layer_ids), num_anchors=512, enable_confidence_head=True,
                  confidence_head_with_markov=True, markov_rank=c.markov_rank, markov_head_type="vanilla")
    gen = torch.Generator().manual_seed(9)
    frozen = {"embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=gen),
              "lm_head.weight": torch.randn(c.vocab_size, c.hidden_size, generator=gen)}
    return _write(out, config, drafter, override, frozen)


def _write(out: Path, config: dict, drafter, override: dict, extra: dict | None = None) -> Path:
    """config.json with `override` applied (a None deletes the key) and the drafter's tensors, but for a
    `drop=(prefixes)` in `override`, and `extra` ones."""
    drop = override.pop("drop", ())
    config.update(override)
    config = {k: v for k, v in config.items() if v is not None or k not in override}  # None: deleted
    tensors = {k: v.float() for k, v in drafter.state_dict().items() if not k.startswith(tuple(drop))}
    tensors.update(extra or {})
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def logits(drafter, seed=0, seq=24, anchors=(3, 9, 15)):
    """Block logits and confidence [N*B, V], [N*B] of the training forward on seeded random taps."""
    c = drafter.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (1, seq), generator=gen)
    taps = torch.randn(1, seq, c.num_taps * c.hidden_size, generator=gen, dtype=torch.float64)
    embed = torch.randn(V, c.hidden_size, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(V, c.hidden_size, generator=gen, dtype=torch.float64) * 0.2
    a = torch.tensor([anchors])
    masks = build_training_masks(MaskSpec(seq, c.block_size, len(anchors), c.sliding_window, c.window_causal),
                                 c.layer_types, a, torch.ones_like(a, dtype=torch.bool), "dense")
    hidden = drafter(embed[block_inputs(ids, a, c.block_size, c.mask_token_id)], taps,
                     position_ids(seq, a, c.block_size), masks, "dense")[0]  # [N*B, H]
    out = hidden @ lm_head.T
    confidence = None
    if c.arch == "dspark":
        prev = ids[0, (a[0, :, None] + torch.arange(c.block_size)).reshape(-1)]  # slot k's previous token: a + k
        emb, weight = drafter.logit_bias(prev, None)
        out = out + emb @ weight.T
        confidence = drafter.acceptance_logits(hidden, prev)
    return out, confidence


def f32_drafter(arch, **kw):
    """`arch_drafter` with float32 values (checkpoints store float32), computed in float64."""
    return arch_drafter(arch, **kw).float().double()


def assert_same_drafter(loaded, original):
    assert type(loaded) is type(original)
    assert dataclasses.replace(loaded.config, extra={}) == dataclasses.replace(original.config, extra={})
    got, want = logits(loaded.double()), logits(original)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    if want[1] is not None:
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch,window", [("dflash", None), ("dflash", 64), ("dflash2", 64), ("dspark", 64),
                                         ("dspark", None)])
@pytest.mark.parametrize("causal", [True, False])
def test_a_speculators_checkpoint_loads_with_the_same_logits(arch, window, causal, tmp_path):
    drafter = f32_drafter(arch, seed=1, block=4, window=window)
    drafter.config = dataclasses.replace(drafter.config, window_causal=causal)  # the window's two readings
    out = write_speculators(drafter, tmp_path / "spec")
    assert config_problems(out) == []
    loaded = load_drafter(out, num_target_layers=drafter.config.num_target_layers)
    assert loaded.format == "speculators" and bool(loaded.notes) == (window is not None)
    assert_same_drafter(loaded.drafter, drafter)


def test_a_deepspec_checkpoint_loads_with_the_same_logits(tmp_path):
    target_config = tiny_target_config(rope_theta=5000.0)  # written only inside rope_parameters by transformers 5
    drafter = f32_drafter("dspark", seed=2, block=4)
    drafter.config = dataclasses.replace(drafter.config, rope_theta=5000.0)
    out = write_deepspec(drafter, target_config, tmp_path / "ds")
    assert "rope_theta" not in json.loads((out / "config.json").read_text())
    loaded = load_drafter(out)
    assert loaded.format == "deepspec"
    assert_same_drafter(loaded.drafter, drafter)


def test_a_deepspec_dflash_is_our_dspark_without_heads(tmp_path):
    """DeepSpec's DFlash: its DSpark with markov_rank 0 and no confidence head (config/dflash/*.py), drafting
    from the anchor's slot: ours with a zero Markov bias, the same logits."""
    drafter = f32_drafter("dspark", seed=6)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()  # the reference: no bias
    out = write_deepspec(drafter, tiny_target_config(), tmp_path / "dflash", markov_rank=0,
                         enable_confidence_head=False, markov_head_type=None, confidence_head_with_markov=None,
                         drop=("markov_head.", "confidence_head."))
    loaded = load_drafter(out)
    assert loaded.drafter.config.arch == "dspark" and loaded.drafter.config.markov_rank == 1
    assert any("no Markov head" in n for n in loaded.notes) and any("no confidence head" in n for n in loaded.notes)
    torch.testing.assert_close(logits(loaded.drafter.double())[0], logits(drafter)[0], rtol=1e-6, atol=1e-6)


def test_a_confidence_head_on_the_hidden_state_alone_reads_as_ours(tmp_path):
    drafter = f32_drafter("dspark", seed=7)
    h = drafter.config.hidden_size
    with torch.no_grad():
        drafter.confidence_head.proj.weight[:, h:] = 0  # the reference: no weight on the Markov input
    out = write_speculators(drafter, tmp_path / "spec", confidence_head_with_markov=False)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["confidence_head.proj.weight"] = tensors["confidence_head.proj.weight"][:, :h].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    loaded = load_drafter(out, num_target_layers=8)
    assert any("hidden state alone" in n for n in loaded.notes)
    assert_same_drafter(loaded.drafter, drafter)


def test_a_zlab_config_with_rope_parameters_alone_keeps_its_rope_theta(tmp_path):
    """transformers 5 writes RoPE into `rope_parameters` only (the z-lab DFlash 2 fixture does): not 1e6."""
    from dflash_train.model.drafter.export.hf_format import load_zlab

    drafter = f32_drafter("dflash", seed=8)
    drafter.config = dataclasses.replace(drafter.config, rope_theta=5000.0)
    out = save_zlab(drafter, tmp_path / "z", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    (out / "config.json").write_text(json.dumps(config))
    assert load_zlab(out).config.rope_theta == 5000.0
    assert_same_drafter(load_drafter(out).drafter, drafter)


def test_formats_are_told_apart_and_ours_still_load(tmp_path):
    drafter = f32_drafter("dspark", seed=3)
    ours = save_zlab(drafter, tmp_path / "ours", dtype=torch.float32)
    assert detect_format(json.loads((ours / "config.json").read_text())) == "zlab"
    assert load_drafter(ours).format == "zlab"
    assert_same_drafter(load_drafter(ours).drafter, drafter)
    assert detect_format({"speculators_model_type": "dspark", "architectures": ["DSparkDraftModel"]}) == "speculators"
    assert detect_format({"architectures": ["Qwen3DSparkModel"], "block_size": 7}) == "deepspec"
    assert detect_format({"architectures": ["DFlashDraftModel"]}) == "zlab"


@pytest.mark.parametrize("change,key", [
    ({"speculators_model_type": "eagle3"}, "speculators_model_type"),
    ({"draft_vocab_size": 32}, "draft_vocab_size"),
    ({"sample_from_anchor": False}, "sample_from_anchor"),
    ({"aux_hidden_state_layer_ids": [0, 3, 5]}, "aux_hidden_state_layer_ids"),
    ({"mask_token_id": None}, "mask_token_id"),
    ({"target_hidden_size": 128}, "target_hidden_size"),
    ({"block_size": None}, "block_size"),
])
def test_speculators_settings_our_classes_cannot_run_are_refused_by_file_and_key(change, key, tmp_path):
    out = write_speculators(arch_drafter("dspark"), tmp_path / "spec", **change)
    with pytest.raises(ValueError, match=rf"{out / 'config.json'}: .*{key}"):
        load_drafter(out, num_target_layers=8)


def test_a_scaled_rope_and_an_embedding_tap_are_refused(tmp_path):
    drafter = arch_drafter("dspark")
    yarn = write_deepspec(drafter, tiny_target_config(), tmp_path / "yarn",
                          rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    embedding = write_deepspec(drafter, tiny_target_config(), tmp_path / "emb", target_layer_ids=[-1, 3, 6])
    with pytest.raises(UnsupportedDrafter, match="rope_parameters.rope_type: 'yarn'"):
        load_drafter(yarn)
    assert "target_layer_ids" in config_problems(embedding)[0] and "embedding output" in config_problems(embedding)[0]
    with pytest.raises(ValueError, match="no verifier layer count"):  # the speculators format does not record it
        load_drafter(write_speculators(drafter, tmp_path / "spec"))


@pytest.mark.parametrize("writer", ["speculators", "deepspec"])
def test_greedy_speculative_output_equals_plain_greedy(writer, tmp_path):
    from tests.eval.eval_helpers import tiny_target

    target = tiny_target(seed=0, layers=8, vocab=97, hidden=64, head_dim=16)
    drafter = arch_drafter("dspark", seed=4, block=4)
    out = (write_speculators(drafter, tmp_path / "c") if writer == "speculators"
           else write_deepspec(drafter, target.config, tmp_path / "c"))
    loaded = load_drafter(out, num_target_layers=8, dtype=torch.float64).drafter.eval()
    g = torch.Generator().manual_seed(1)
    for n in (5, 11):
        prompt = torch.randint(0, 96, (1, n), generator=g)
        spec = speculative_generate(target, loaded, target.get_input_embeddings().weight,
                                    target.get_output_embeddings().weight, loaded.config.target_layer_ids, prompt, 24, [])
        assert spec.tokens == target_generate(target, prompt, 24, []).tokens


# ---------------------------------------------------------------------------------------------
# speculators' own code (installed on a developer's machine, not in CI)


def _speculators():
    sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "bench" / "peers"))
    import peer_env

    if peer_env.speculators_version() is None:
        pytest.skip("speculators 0.9.0 is not installed (bench/peers/README.md)")
    import speculators.train.cli as cli

    return cli


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("verifier")
    Qwen3ForCausalLM(tiny_target_config(tie_word_embeddings=True)).save_pretrained(out)
    return out


def their_model(kind: str, verifier: Path, data_dir: Path):
    """A drafter built as speculators' `train` builds one, with its defaults for `kind` (TrainConfig)."""
    import argparse

    cli = _speculators()
    from speculators.model import SpeculatorModel
    from speculators.train.config.schema import TrainConfig

    cfg = TrainConfig(speculator_type=kind, verifier={"verifier_name_or_path": str(verifier)},
                      draft={"target_layer_ids": [2, 4, 7], "mask_token_id": MASK, "num_layers": 2,
                             "draft_attn_impl": "sdpa", "sliding_window": 64},
                      dflash={"block_size": 4}, data={"data_path": str(data_dir)})
    args = argparse.Namespace(**cfg.flatten())
    d2t, t2d, vocab = cli.parse_vocab_mappings(args)
    model = cli.build_draft_model(args, SpeculatorModel.registry[kind], t2d, d2t, vocab)
    with torch.no_grad():  # their fresh Markov bias and convolutions start at zero: move them
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if p.requires_grad and any(k in name for k in ("markov", "conv", "codebook", "confidence")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def their_logits(model, seq=40):
    """Their training forward's block logits (with DSpark's Markov bias) and confidence, and the inputs."""
    gen = torch.Generator().manual_seed(3)
    k, h = len(model.target_layer_ids), model.config.transformer_layer_config.hidden_size
    batch = {"hidden_states": torch.randn(1, seq, k * h, generator=gen),
             "input_ids": torch.randint(0, V - 1, (1, seq), generator=gen),
             "loss_mask": torch.ones(1, seq, dtype=torch.long),
             "verifier_last_hidden_states": torch.randn(1, seq, h, generator=gen),
             "document_ids": torch.zeros(1, seq, dtype=torch.long), "position_ids": torch.arange(seq)[None]}
    with torch.no_grad():
        hidden, out, _, _, index = model._backbone_forward(**batch, max_anchors=3)
        confidence = None
        if getattr(model, "markov_head", None) is not None:
            b = model.block_size
            prev = batch["input_ids"][0, index].view(-1, b)
            blocks = hidden.view(-1, b, h)
            out = out.view(-1, b, V) + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=blocks)
            emb = model.markov_head.prev_embeddings(prev)
            confidence = model.confidence_head(torch.cat([blocks, emb], -1)).reshape(-1)
    return out.reshape(-1, V), confidence, batch, index.view(-1, model.block_size)[:, 0]


def our_logits(drafter, model, batch, anchors):
    c = drafter.config
    ids, seq = batch["input_ids"], batch["input_ids"].shape[1]
    a = anchors[None]
    masks = build_training_masks(MaskSpec(seq, c.block_size, a.shape[1], c.sliding_window, c.window_causal),
                                 c.layer_types, a, torch.ones_like(a, dtype=torch.bool), "dense")
    embed, lm_head = model.embed_tokens.weight, model.lm_head.weight
    with torch.no_grad():
        hidden = drafter(embed[block_inputs(ids, a, c.block_size, c.mask_token_id)], batch["hidden_states"],
                         position_ids(seq, a, c.block_size), masks, "dense")[0]
        out, confidence = hidden @ lm_head.T, None
        if c.arch == "dspark":
            prev = ids[0, (anchors[:, None] + torch.arange(c.block_size)).reshape(-1)]
            emb, weight = drafter.logit_bias(prev, None)
            out, confidence = out + emb @ weight.T, drafter.acceptance_logits(hidden, prev)
    return out, confidence


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
def test_a_checkpoint_speculators_writes_loads_with_its_logits(kind, verifier_dir, tmp_path):
    model = their_model(kind, verifier_dir, tmp_path / "data")
    model.save_pretrained(tmp_path / "ckpt")
    assert config_problems(tmp_path / "ckpt") == []
    loaded = load_drafter(tmp_path / "ckpt", num_target_layers=8)
    assert loaded.format == "speculators" and loaded.drafter.config.arch == kind
    theirs, their_conf, batch, anchors = their_logits(model)
    ours, our_conf = our_logits(loaded.drafter.eval(), model, batch, anchors)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    if kind == "dspark":
        torch.testing.assert_close(our_conf, their_conf, rtol=1e-4, atol=1e-4)
