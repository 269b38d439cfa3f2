import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from dflash_train.data.anchors import block_inputs, position_ids
from dflash_train.model.drafter.attention import MaskSpec, build_training_masks
from dflash_train.model.drafter.config import DrafterConfig, drafter_config_from_target
from dflash_train.model.drafter.backbone import ContextCache, DFlashDrafter, rope_cos_sin


def tiny_target_config(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=97, rope_theta=10000.0, rms_norm_eps=1e-6)
    base.update(kw)
    return Qwen3Config(**base)


def tiny_drafter(seed=0, window=None, layers=2, block=4):
    cfg = drafter_config_from_target(tiny_target_config(), num_layers=layers, block_size=block, mask_token_id=96,
                                     num_taps=3, sliding_window=window)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).double()
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-trivial norm weights so a wrong norm placement shows
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter


def test_layer_with_empty_context_equals_hf_qwen3_layer():
    hf_cfg = tiny_target_config()
    hf_cfg._attn_implementation = "sdpa"  # eager HF softmaxes in float32; sdpa stays in float64
    drafter = tiny_drafter()
    ours = drafter.layers[0]
    ref = Qwen3DecoderLayer(hf_cfg, layer_idx=0).double()
    ref.self_attn.is_causal = False  # DFlash blocks are bidirectional
    ref.load_state_dict(ours.state_dict())  # same parameter names as HF
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    pos = torch.arange(3, 10)[None].expand(2, 7)
    cos, sin = Qwen3RotaryEmbedding(hf_cfg)(x, pos)
    expected = ref(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    expected = expected[0] if isinstance(expected, tuple) else expected
    empty = (torch.zeros(2, 2, 0, 16, dtype=torch.float64),) * 2
    got = ours(x, empty, cos, sin, None, "sdpa")
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    # our RoPE tables equal HF's (both are computed in float32)
    c, s = rope_cos_sin(pos, 16, 10000.0)
    torch.testing.assert_close(c.double(), cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(s.double(), sin, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 6])
def test_training_layout_equals_inference_drafting(window):
    """Each training block equals a real draft step: context cache of taps before the anchor, the
    block at positions anchor..anchor+B-1 (spec 1.6, 1.7). Catches mask, RoPE and layout errors."""
    drafter = tiny_drafter(window=window)
    S, B, K, H = 30, 4, 3, 64
    gen = torch.Generator().manual_seed(3)
    taps = torch.randn(1, S, K * H, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 96, (1, S), generator=gen)
    embed = torch.randn(97, H, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[1, 9, 17, 28]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    spec = MaskSpec(S, B, 4, window)
    masks = build_training_masks(spec, drafter.config.layer_types, anchors, keep, "sdpa")
    block_embeds = embed[block_inputs(ids, anchors, B, 96)]
    out = drafter(block_embeds, taps, position_ids(S, anchors, B), masks, "sdpa")  # [1, N*B, H]
    for j, a in enumerate(anchors[0].tolist()):
        cache = ContextCache()
        cache.append(drafter, taps[:, :a])
        block_pos = torch.arange(a, a + B)[None]
        draft = drafter.draft(block_embeds[:, j * B:(j + 1) * B], cache, block_pos)
        torch.testing.assert_close(out[:, j * B:(j + 1) * B], draft, atol=1e-10, rtol=1e-10)


def test_context_cache_grows_incrementally_like_one_prefill():
    drafter = tiny_drafter()
    taps = torch.randn(1, 12, 3 * 64, dtype=torch.float64)
    whole, parts = ContextCache(), ContextCache()
    whole.append(drafter, taps)
    parts.append(drafter, taps[:, :5])
    parts.append(drafter, taps[:, 5:])
    assert parts.length == 12
    for (k0, v0), (k1, v1) in zip(whole.kv, parts.kv):
        torch.testing.assert_close(k0, k1)
        torch.testing.assert_close(v0, v1)


def test_gradients_reach_the_drafter_and_only_the_block_inputs_it_is_given():
    """The drafter owns no embedding or lm_head (the target's stay frozen outside it: an optimizer
    over `drafter.parameters()` cannot touch them), every drafter parameter gets a gradient, and
    the block sees only its anchor token and mask tokens: given an embedding that requires grad,
    exactly those rows receive one (a label leaking into the block input would add rows)."""
    drafter = tiny_drafter().float()
    gen = torch.Generator().manual_seed(5)
    embed = torch.randn(97, 64, generator=gen).requires_grad_(True)
    lm_head = torch.randn(97, 64, generator=gen).requires_grad_(True)
    taps = torch.randn(1, 20, 3 * 64, generator=gen)
    anchors, keep = torch.tensor([[3, 10]]), torch.tensor([[True, True]])
    masks = build_training_masks(MaskSpec(20, 4, 2), drafter.config.layer_types, anchors, keep, "sdpa")
    ids = torch.randint(0, 96, (1, 20), generator=gen)
    out = drafter(embed[block_inputs(ids, anchors, 4, 96)], taps, position_ids(20, anchors, 4), masks, "sdpa")
    (out @ lm_head.T).logsumexp(-1).sum().backward()
    prefixes = {n.split(".")[0] for n, _ in drafter.named_parameters()}
    assert prefixes == {"layers", "fc", "hidden_norm", "norm"}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    fed_rows = {int(ids[0, 3]), int(ids[0, 10]), 96}  # the two anchor tokens and the mask token
    assert {int(r) for r in embed.grad.abs().sum(-1).nonzero()} == fed_rows
    assert bool((lm_head.grad.abs().sum(-1) > 0).all())  # the logsumexp reaches every lm_head row


def test_drafter_config_validation_names_the_field():
    tc = tiny_target_config()
    with pytest.raises(ValueError, match="block_size"):
        drafter_config_from_target(tc, num_layers=1, block_size=1, mask_token_id=5)
    with pytest.raises(ValueError, match="mask_token_id"):
        drafter_config_from_target(tc, num_layers=1, block_size=4, mask_token_id=97)
    with pytest.raises(ValueError, match="target_layer_ids"):
        drafter_config_from_target(tc, num_layers=1, block_size=4, mask_token_id=5, target_layer_ids=[1, 8])
    cfg = drafter_config_from_target(tc, num_layers=1, block_size=4, mask_token_id=5)
    with pytest.raises(ValueError, match="hidden_size"):
        cfg.check_target(target_hidden_size=128, target_num_layers=8, target_vocab_size=97)


def test_config_is_derived_and_never_inherits_partial_rope():
    tc = tiny_target_config(partial_rotary_factor=0.25, rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = drafter_config_from_target(tc, num_layers=3, block_size=16, mask_token_id=5)
    assert isinstance(cfg, DrafterConfig)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.target_layer_ids == (1, 2, 3, 4, 5)  # z-lab formula over [1, L-3] for L=8, 5 taps
    assert cfg.rope_theta == 10000.0
    from dflash_train.model.drafter.export.hf_format import zlab_config_dict

    written = zlab_config_dict(cfg)
    assert "partial_rotary_factor" not in written and written["rope_scaling"] is None


@pytest.mark.parametrize("backend", ["sdpa", "dense", "flex"])
@pytest.mark.parametrize("window", [None, 6])
def test_pitfall_1_overlapping_anchors_never_see_their_own_or_later_context(backend, window):
    """Published pitfall 1 (SpecForge #470/#473): with anchors a < a' < a + B in one row, block a'
    must not see target states at or after a' (its own anchor's state is unavailable when drafting):
    perturbing the taps at positions >= a' leaves block a''s (and block a's) outputs unchanged, and
    perturbing position a' - 1 does change block a''s."""
    drafter = tiny_drafter(window=window)
    S, B, H = 30, 4, 64
    gen = torch.Generator().manual_seed(9)
    taps = torch.randn(1, S, 3 * H, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 96, (1, S), generator=gen)
    embed = torch.randn(97, H, generator=gen, dtype=torch.float64)
    anchors, keep = torch.tensor([[10, 12, 20]]), torch.ones(1, 3, dtype=torch.bool)  # 10 < 12 < 10 + B
    masks = build_training_masks(MaskSpec(S, B, 3, window), drafter.config.layer_types, anchors, keep, backend,
                                 compiled_builder=False)
    blocks, pos = embed[block_inputs(ids, anchors, B, 96)], position_ids(S, anchors, B)

    def run(t):
        try:
            with torch.no_grad():  # flex has no backward on the CPU
                return drafter(blocks, t, pos, masks, backend)[0].view(3, B, H)
        except Exception as e:  # flex's forward is optional on CPU builds
            pytest.skip(f"{backend} unavailable here: {e}")

    base = run(taps)
    later = taps.clone()
    later[:, 12:] += 5.0  # the second anchor's own state and everything after it
    moved = run(later)
    torch.testing.assert_close(moved[:2], base[:2], rtol=0, atol=1e-12)  # blocks of anchors 10 and 12
    assert (moved[2] - base[2]).abs().max() > 1e-3  # anchor 20 sees positions 12..19
    before = taps.clone()
    before[:, 11] += 5.0
    assert (run(before)[1] - base[1]).abs().max() > 1e-3  # position a' - 1 is visible to block a'


def test_rope_is_cast_once_per_forward_to_the_same_values_and_left_float32_under_autocast(monkeypatch):
    """Issue 37: `run_layers` and `context_kv` cast cos/sin to the layers' dtype once (not two casts per
    `apply_rope`): a bf16 drafter's context keys and block output are bitwise those of the per-layer casts;
    under autocast, where a layer's queries may be in another dtype than its input, they stay float32."""
    from dflash_train.model.drafter import backbone

    drafter = tiny_drafter(window=None, layers=2).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 7, drafter.config.num_taps * 64, generator=gen).to(torch.bfloat16)
    block = torch.randn(1, 4, 64, generator=gen).to(torch.bfloat16)
    ctx_pos, block_pos = torch.arange(7)[None], torch.arange(7, 11)[None]
    with torch.no_grad():
        kv = drafter.context_kv(drafter.fuse_context(ctx), ctx_pos)
        out = drafter.run_layers(block, kv, block_pos, {}, "sdpa", 4)
        rope_in = backbone.rope_in
        monkeypatch.setattr(backbone, "rope_in", lambda x, cos_sin: cos_sin)  # apply_rope casts, per layer, as before
        kv_ref = drafter.context_kv(drafter.fuse_context(ctx), ctx_pos)
        out_ref = drafter.run_layers(block, kv_ref, block_pos, {}, "sdpa", 4)
    assert all(torch.equal(a, b) for pair, ref in zip(kv, kv_ref) for a, b in zip(pair, ref))
    assert torch.equal(out, out_ref)
    cos_sin = rope_cos_sin(block_pos, 16, 10000.0)
    assert [t.dtype for t in rope_in(block, cos_sin)] == [torch.bfloat16] * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(a is b for a, b in zip(rope_in(block.float(), cos_sin), cos_sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_equals_hf_qwen3_rms_norm_bit_for_bit(dtype):
    """The drafter's norm runs `F.rms_norm` (one fused kernel where torch has one): the same bits as HF's
    spelled-out Qwen3RMSNorm on the CPU, in bf16 (where the cast before the scale matters) and float32."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from dflash_train.model.drafter.backbone import RMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(576, 1e-6).to(dtype), Qwen3RMSNorm(576, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    x = (torch.randn(3, 9, 576) * torch.logspace(-3, 2, 9)[None, :, None]).to(dtype)  # rows 5 decades apart
    assert torch.equal(ours(x), ref(x))
