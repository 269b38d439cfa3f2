"""The architectures users train drafters for: MoE (Qwen3-MoE, gpt-oss), hybrid linear attention
(Qwen3-Next, Qwen3.5), sliding window (gpt-oss, Gemma 3) and Llama 3 (llama3 rope scaling).

Each is a tiny seeded random model over the SmolLM2 tokenizer (so the real chat template is used),
wrapped as a `Target`, and checked against references: taps vs HF `output_hidden_states` (z-lab
semantics, id i = hidden_states[i + 1]), regenerate+tap vs a separate full forward of the final
ids, the derived drafter config vs the target (dflash-spec.md 1.2, 1.7, 3.1), and the derived embedding
and logit scaling vs the target's own forward (model/target/scaling.py)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from dflash_train.data.records import Conversation
from dflash_train.data.regen_taps import has_recurrent_layers, regenerate_with_taps
from dflash_train.model.drafter.attention import FULL, SLIDING
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.export.hf_format import zlab_config_dict
from dflash_train.model.target.scaling import Scaling
from dflash_train.model.target.target import Target

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
             tie_word_embeddings=True)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
HYBRID_TYPES = ["linear_attention", "linear_attention", "full_attention"]
# name: (config class, model class, config kwargs, the rope theta the drafter must take)
ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 1e6),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_hidden_layers=3, layer_types=HYBRID_TYPES, intermediate_size=128,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                        num_experts_per_tok=2, **LINEAR), 10000.0),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(num_hidden_layers=3, layer_types=HYBRID_TYPES, intermediate_size=128, **LINEAR,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                      "mrope_section": [1, 1, 0], "mrope_interleaved": True}), 1e7),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_hidden_layers=3, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=8), 150000.0),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, intermediate_size=128, sliding_window=8, sliding_window_pattern=2), 1e6),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(num_hidden_layers=3, intermediate_size=128,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}), 500000.0),
}
MOE = {"qwen3_moe", "qwen3_next", "gpt_oss"}
EMBED_SCALE = {"gemma3": 8.0}  # sqrt(hidden_size): the drafter's block embeddings are scaled as the target's
# Targets that scale their logits (model/target/scaling.py), checked against their own forward; not trained for yet
SCALED_LOGITS = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_hidden_layers=3, intermediate_size=128, sliding_window=8),
               (8.0, 1.0, 30.0)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(num_hidden_layers=3, intermediate_size=128, embedding_multiplier=12.0, logits_scaling=8.0),
                (12.0, 0.125, None)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_hidden_layers=3, intermediate_size=128, logit_scale=0.0625),
               (1.0, 0.0625, None)),
}
# Experts add their outputs in float32 in an order that depends on the batch's routing, so MoE taps
# match HF's to float32 rounding; dense and hybrid ones match exactly.
MOE_ATOL = 1e-5


def _classes(name: str):
    config_cls, model_cls, _, _ = ARCHS[name]
    missing = [c for c in (config_cls, model_cls) if not hasattr(transformers, c)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)}")
    return getattr(transformers, config_cls), getattr(transformers, model_cls)


def tiny_config(name: str, vocab_size: int):
    config_cls, _ = _classes(name)
    return config_cls(**SMALL, **ARCHS[name][2], vocab_size=vocab_size)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_target(request, smollm2_tokenizer):
    """A seeded random tiny target of one architecture over the SmolLM2 tokenizer."""
    name = request.param
    _, model_cls = _classes(name)
    torch.manual_seed(0)
    model = model_cls(tiny_config(name, len(smollm2_tokenizer))).eval().requires_grad_(False)
    model.generation_config.eos_token_id = smollm2_tokenizer.eos_token_id
    return name, Target(model=model, tokenizer=smollm2_tokenizer, name=name)


def test_tiny_targets_have_the_layers_they_claim(arch_target):
    name, target = arch_target
    assert target.num_layers == 3 and target.hidden_size == 64
    assert has_recurrent_layers(target.config) == (name in ("qwen3_next", "qwen3_5"))
    if name in ("gpt_oss", "gemma3"):
        assert SLIDING in target.config.layer_types and FULL in target.config.layer_types
    if name in MOE:
        assert any("expert" in n for n, _ in target.model.named_modules())


def test_taps_equal_hf_hidden_states(arch_target):
    name, target = arch_target
    ids = torch.randint(0, target.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding: the valid tokens are unaffected
    out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    atol = MOE_ATOL if name in MOE else 0.0
    for layer_ids in ([0, 1], [1], [0, 2]):  # 2 = last layer: HF's entry is post-norm
        ref = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        got = target.taps(ids, mask, layer_ids)
        assert got.shape == (2, 20, 64 * len(layer_ids))
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=atol)
        torch.testing.assert_close(got[1, :15], ref[1, :15], rtol=0, atol=atol)


def test_regenerate_and_tap_equal_a_full_forward(arch_target):
    """Batched (left-padded) greedy regeneration with a KV / recurrent cache: the taps kept on the
    way equal a separate unpadded forward, and the response is the target's own greedy reply."""
    name, target = arch_target
    convs = [Conversation("long", [{"role": "user", "content": "Explain how a bicycle stays upright."}]),
             Conversation("short", [{"role": "user", "content": "hi"}])]
    tapped, report = regenerate_with_taps(target, convs, [0, 1], max_new_tokens=6, batch_size=2, max_len=256,
                                          storage_dtype=torch.float32)
    assert report["samples"] == 2
    for sample, taps in zip(tapped.samples, tapped.taps):
        ids = torch.tensor([sample.input_ids])
        n = len(sample) - 1  # the last response token is never fed back: no tap
        torch.testing.assert_close(taps[:n], target.taps(ids, None, [0, 1])[0, :n], rtol=1e-4, atol=1e-4)
        assert taps[-1].abs().sum() == 0
        prompt_len = sample.loss_mask.index(1)
        greedy = target.model(ids).logits[0, prompt_len - 1:-1].argmax(-1)
        assert greedy.tolist() == list(sample.input_ids[prompt_len:])


@pytest.mark.parametrize("name", list(ARCHS))
def test_drafter_config_follows_the_target(name):
    """Spec 1.2/1.7/3.1: width, head_dim, vocab and rope_theta from the target; the drafter's own
    layer_types (never the target's linear/sliding pattern); no partial rotary, rope scaling or M-RoPE;
    a dense MLP of 3 x hidden for MoE targets."""
    cfg = tiny_config(name, vocab_size=300)
    d = drafter_config_from_target(cfg, num_layers=2, block_size=4, mask_token_id=7, target_layer_ids=(0, 1))
    assert d.scaling == Scaling(EMBED_SCALE.get(name, 1.0), 1.0, None)
    assert (d.hidden_size, d.head_dim, d.num_heads, d.num_kv_heads, d.vocab_size) == (64, 16, 4, 2, 300)
    assert d.rope_theta == ARCHS[name][3]
    assert d.layer_types == (FULL, FULL) and d.sliding_window is None
    assert d.num_target_layers == 3 and d.target_layer_ids == (0, 1)
    assert d.intermediate_size == (3 * 64 if name in MOE else 128)
    assert d.attention_bias == bool(getattr(cfg, "attention_bias", False))
    windowed = drafter_config_from_target(cfg, num_layers=3, block_size=4, mask_token_id=7, target_layer_ids=(0, 1),
                                          sliding_window=16, window_layers="all_but_last")
    assert windowed.layer_types == (SLIDING, SLIDING, FULL) and windowed.sliding_window == 16
    assert drafter_config_from_target(cfg, num_layers=3, block_size=4, mask_token_id=7, target_layer_ids=(0, 1),
                                      sliding_window=16).layer_types == (SLIDING,) * 3
    exported = zlab_config_dict(d)
    assert exported["rope_theta"] == ARCHS[name][3] and exported["rope_scaling"] is None
    assert exported["head_dim"] == 16 and exported["vocab_size"] == 300 and exported["hidden_size"] == 64
    assert not {"partial_rotary_factor", "mrope_section", "rope_parameters"} & set(exported)
    assert exported["dflash_config"].get("input_embedding_scale") == EMBED_SCALE.get(name)  # absent: the identity


def test_the_derived_scaling_is_the_targets_own_forward(arch_target):
    """The scaling the drafter copies (derived from the config) equals what the target's forward does: its
    first layer reads the embedding rows times the scale, its logits are the final hidden's lm_head scores;
    a wrong scaling is named."""
    name, target = arch_target
    d = drafter_config_from_target(target.config, num_layers=1, block_size=4, mask_token_id=7, target_layer_ids=(0,))
    assert target.scaling_problems(d.scaling) == []
    wrong = target.scaling_problems(Scaling(d.input_embedding_scale * 2, 1.0, None))
    assert len(wrong) == 1 and wrong[0].startswith("input_embedding_scale")
    assert target.scaling_problems(Scaling(d.input_embedding_scale, 1.0, 0.5))[0].startswith("output_multiplier")


@pytest.mark.parametrize("name", list(SCALED_LOGITS))
def test_targets_that_scale_their_logits_are_derived_and_measured(name):
    """Gemma 2 (soft cap 30, a default its config.json leaves out), Granite (divides by logits_scaling)
    and Cohere (multiplies by logit_scale): the derived fields equal the tiny model's own forward."""
    config_name, model_name, kwargs, expected = SCALED_LOGITS[name]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(**SMALL, **kwargs, vocab_size=300)
    target = Target(model=getattr(transformers, model_name)(cfg).eval(), tokenizer=None, name=name)
    d = drafter_config_from_target(cfg, num_layers=1, block_size=4, mask_token_id=7, target_layer_ids=(0,))
    assert (d.input_embedding_scale, d.output_multiplier, d.final_logit_softcapping) == expected
    assert target.scaling_problems(d.scaling) == []
    assert target.scaling_problems(Scaling(expected[0], expected[1] * 2, expected[2])) != []  # measured, not assumed


def test_multimodal_qwen3_5_derives_from_its_text_config():
    """`Qwen3_5Config` is the vision-language wrapper: the drafter comes from its `text_config`
    (its M-RoPE sections and partial rotary factor are not inherited)."""
    if not hasattr(transformers, "Qwen3_5Config"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3_5Config")
    text = dict(SMALL, **ARCHS["qwen3_5"][2], vocab_size=300)
    cfg = transformers.Qwen3_5Config(text_config=text)
    d = drafter_config_from_target(cfg, num_layers=2, block_size=4, mask_token_id=7, target_layer_ids=(0, 1))
    assert (d.hidden_size, d.head_dim, d.vocab_size, d.num_target_layers, d.rope_theta) == (64, 16, 300, 3, 1e7)


def test_targets_the_engines_cannot_serve_are_refused_with_the_reason():
    cfg = tiny_config("llama3", vocab_size=300)
    big_heads = transformers.LlamaConfig(**{**SMALL, "head_dim": 512}, num_hidden_layers=3, vocab_size=300)
    with pytest.raises(ValueError, match="head_dim 512 cannot be served"):
        drafter_config_from_target(big_heads, num_layers=2, block_size=4, mask_token_id=7)
    d = drafter_config_from_target(cfg, num_layers=2, block_size=4, mask_token_id=7, target_layer_ids=(0, 1))
    with pytest.raises(ValueError, match="widths must match"):
        d.check_target(target_hidden_size=96, target_num_layers=3, target_vocab_size=300)
    assert math.isclose(d.rope_theta, 500000.0)
