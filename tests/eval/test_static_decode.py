"""The fixed-shape eval decoder reproduces the dynamic loops token for token (and HF generate), for every
head, and its CUDA graphs replay what the eager steps compute."""

import dataclasses

import pytest
import torch
from eval_helpers import tiny_target

from dflash_train.eval.spec_decode import DraftHead, speculative_generate, target_generate
from dflash_train.eval.static_decode import StaticDecoder, static_reason
from dflash_train.model.drafter.heads.architectures import HEADS, build_drafter
from dflash_train.model.drafter.config import drafter_config_from_target


def _drafter(target, arch: str, block_size: int, dtype=torch.float64, **extra):
    cfg = drafter_config_from_target(target.config, num_layers=2, block_size=block_size, mask_token_id=96,
                                     num_taps=2, arch=arch)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in dict(selector_rank=8, selector_top_k=4, markov_rank=8,
                                                            domino_gru_dim=16, domino_emb_dim=16, **extra).items()
                                      if hasattr(cfg, k)})
    drafter = build_drafter(cfg).to(dtype)
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the heads' own parts off their neutral start, so their chains matter
        for name, p in drafter.named_parameters():
            if any(k in name for k in ("codebook", "markov", "conv", "gru", "embed_proj")):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype) * 0.3)
    return drafter.eval()


def _decoder(target, drafter, block_size, max_new, device=None):
    head = DraftHead.of(target.get_output_embeddings().weight, scaling=drafter.config.scaling)
    return StaticDecoder(target, drafter, target.get_input_embeddings().weight, head,
                         drafter.config.target_layer_ids, block_size, max_new)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target(seed=0, layers=6)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (1, n), generator=g) for n in (5, 11, 70)]  # 70: a second length bucket


@pytest.mark.parametrize("arch", sorted(HEADS))
def test_every_head_decodes_as_the_dynamic_loop(qwen3, prompts, arch):
    assert static_reason(qwen3, _drafter(qwen3, arch, 4), 0.0) is None
    for block_size in (2, 4):
        drafter = _drafter(qwen3, arch, block_size)
        decoder = _decoder(qwen3, drafter, block_size, 24)
        for prompt in prompts:
            plain = target_generate(qwen3, prompt, 24, [])
            dynamic = speculative_generate(qwen3, drafter, qwen3.get_input_embeddings().weight,
                                           qwen3.get_output_embeddings().weight, drafter.config.target_layer_ids,
                                           prompt, 24, [], block_size=block_size)
            static = decoder.speculative(prompt, 24, [])
            assert static.tokens == dynamic.tokens == plain.tokens
            assert static.accepted == dynamic.accepted  # the same drafts, cycle by cycle
            assert static.gaps == pytest.approx(dynamic.gaps, abs=1e-6)  # float32 gaps of float64 logits
            assert decoder.plain(prompt, 24, []).tokens == plain.tokens


@pytest.mark.parametrize("arch", sorted(HEADS))
def test_padded_prefills_decode_as_the_exact_length_ones(qwen3, prompts, arch):
    """The GPU's prefills run right-padded to 64 tokens (so one captured graph serves every prompt of a length
    bucket): the padded positions must change nothing, neither the target's cache and logits nor the drafter's
    context, for any head. On the CPU the exact-length prefill stays the default."""
    drafter = _drafter(qwen3, arch, 4)
    exact, padded = _decoder(qwen3, drafter, 4, 24), _decoder(qwen3, drafter, 4, 24)
    assert not exact.pad_prefill
    padded.pad_prefill = True
    for prompt in prompts + prompts[:1]:  # the last: a padded prefill buffer used again
        a, b = padded.speculative(prompt, 24, []), exact.speculative(prompt, 24, [])
        assert a.tokens == b.tokens and a.accepted == b.accepted
        assert a.gaps == pytest.approx(b.gaps, abs=1e-9)
        assert padded.plain(prompt, 24, []).tokens == exact.plain(prompt, 24, []).tokens
    keys = sorted(k for bucket in padded.buckets.values() for k in bucket.prefills)
    assert keys == [(64, False), (64, True), (128, False), (128, True)]  # prompts of 5, 11 and 70 tokens
    assert not any(bucket.prefills for bucket in exact.buckets.values())


def test_the_eval_warms_up_one_prompt_of_each_bucket_and_padded_length(qwen3):
    """So that every graph is captured before the timed decode: a bucket holds prompts of two padded lengths."""
    from dflash_train.eval.evaluate import _warm_up_prompts

    decoder = _decoder(qwen3, _drafter(qwen3, "dflash", 4), 4, 24)  # a cache of prompt + 24 + 5 slots
    sets = {"a": [torch.zeros(1, n, dtype=torch.long) for n in (5, 11, 60)],
            "b": [torch.zeros(1, 70, dtype=torch.long)]}
    assert [ids.shape[1] for ids in _warm_up_prompts(sets, decoder)] == [5, 60]  # buckets 64 and 128
    decoder.pad_prefill = True
    assert decoder.shapes_of(60) == (128, 64) and decoder.shapes_of(70) == (128, 128)
    assert [ids.shape[1] for ids in _warm_up_prompts(sets, decoder)] == [5, 60, 70]
    assert [ids.shape[1] for ids in _warm_up_prompts(sets, None)] == [5]  # the dynamic loops: the first prompt


def test_a_draft_vocabulary_drafts_as_in_the_dynamic_loop(qwen3, prompts):
    drafter = _drafter(qwen3, "dspark", 4)
    vocab = torch.arange(0, 97, 2)  # every other token
    head = DraftHead.of(qwen3.get_output_embeddings().weight, vocab, drafter.config.scaling)
    decoder = StaticDecoder(qwen3, drafter, qwen3.get_input_embeddings().weight, head,
                            drafter.config.target_layer_ids, 4, 24)
    for prompt in prompts:
        dynamic = speculative_generate(qwen3, drafter, qwen3.get_input_embeddings().weight,
                                       qwen3.get_output_embeddings().weight, drafter.config.target_layer_ids,
                                       prompt, 24, [], draft_vocab=vocab)
        static = decoder.speculative(prompt, 24, [])
        assert static.tokens == dynamic.tokens and static.accepted == dynamic.accepted


def test_a_windowed_causal_drafter_and_eos_stop_as_the_dynamic_loop(qwen3, prompts):
    drafter = _drafter(qwen3, "dflash", 4, layer_types=("sliding_attention", "full_attention"), sliding_window=6,
                       window_causal=True)
    decoder = _decoder(qwen3, drafter, 4, 30)
    for prompt in prompts:
        plain = target_generate(qwen3, prompt, 30, [])
        eos = [plain.tokens[7]]  # stops early, maybe inside a cycle's accepted run
        dynamic = speculative_generate(qwen3, drafter, qwen3.get_input_embeddings().weight,
                                       qwen3.get_output_embeddings().weight, drafter.config.target_layer_ids,
                                       prompt, 30, eos)
        static = decoder.speculative(prompt, 30, eos)
        assert static.tokens == dynamic.tokens and static.stopped_by_eos and static.accepted == dynamic.accepted
        assert decoder.plain(prompt, 30, eos).tokens == target_generate(qwen3, prompt, 30, eos).tokens


def test_plain_static_decoding_equals_hf_generate_on_smollm2(smollm2_target):
    t = smollm2_target
    text = t.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                           tokenize=False, add_generation_prompt=True)
    prompt = t.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    drafter = _drafter(t.model, "dflash", 4, dtype=torch.float32)
    decoder = _decoder(t.model, drafter, 4, 24)
    reference = t.model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert decoder.plain(prompt, 24, []).tokens == reference
    assert decoder.speculative(prompt, 24, []).tokens == reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch", sorted(HEADS))
def test_cuda_graph_replays_equal_the_eager_fixed_shape_steps(arch):
    target = tiny_target(seed=0, layers=6, dtype=torch.float32).cuda()
    drafter = _drafter(target, arch, 4, dtype=torch.float32).cuda()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (1, n), generator=g).cuda() for n in (5, 11, 70, 9)]
    graphs, eager = _decoder(target, drafter, 4, 40), _decoder(target, drafter, 4, 40)
    eager.use_graph = False
    for prompt in prompts:
        a, b = graphs.speculative(prompt, 40, []), eager.speculative(prompt, 40, [])
        assert a.tokens == b.tokens and a.accepted == b.accepted
        assert graphs.plain(prompt, 40, []).tokens == eager.plain(prompt, 40, []).tokens
    assert all(bucket.cycle.graph is not None and bucket.plain.graph is not None for bucket in graphs.buckets.values())
    assert all(p.step.graph is not None for bucket in graphs.buckets.values() for p in bucket.prefills.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_gpu_recipe_s_pair_is_captured_and_its_replays_equal_the_eager_steps():
    """Issue 37: the `gpu` recipe's drafter (DSpark, 6 sliding-window layers at SmolLM2's width, block 4) on the
    real SmolLM2 in bfloat16, as the GPU eval decodes: both steps are captured (a failed capture decodes
    eagerly, at about twice a replay's cost) and replay what the eager steps compute."""
    from dflash_train import recipes
    from dflash_train.model.target.load import load_target
    from dflash_train.train.setup import build_drafter_config

    target = load_target("smollm2", dtype=torch.bfloat16, device="cuda")
    cfg = build_drafter_config(recipes.gpu(), target)
    drafter = build_drafter(cfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    drafter = drafter.to("cuda", torch.bfloat16).eval()
    assert cfg.arch == "dspark" and set(cfg.layer_types) == {"sliding_attention"}
    head = DraftHead.of(target.lm_head_weight, None, cfg.scaling)
    graphs, eager = (StaticDecoder(target.model, drafter, target.embed_weight, head, cfg.target_layer_ids,
                                   cfg.block_size, 32) for _ in range(2))
    eager.use_graph = False
    prompt = target.tokenizer("Name three colours of the rainbow.", return_tensors="pt").input_ids.cuda()
    for _ in range(2):  # the first call of a bucket captures, the second replays
        a, b = graphs.speculative(prompt, 32, []), eager.speculative(prompt, 32, [])
        assert a.tokens == b.tokens and a.accepted == b.accepted
        assert graphs.plain(prompt, 32, []).tokens == eager.plain(prompt, 32, []).tokens
    assert all(bucket.cycle.graph is not None and bucket.plain.graph is not None for bucket in graphs.buckets.values())


def test_evaluate_through_the_static_decoder_says_so_and_matches(smollm2_target, tmp_path):
    from dflash_train.eval.evaluate import evaluate

    drafter = _drafter(smollm2_target.model, "dflash", 4, dtype=torch.float32)
    sets = {"chat": [[{"role": "user", "content": "Name three colours of the rainbow."}]]}
    static = evaluate(drafter, smollm2_target, sets, max_new_tokens=12, progress=False, warmup=False,
                      decoder="static", dtype="target")
    dynamic = evaluate(drafter, smollm2_target, sets, max_new_tokens=12, progress=False, warmup=False,
                       decoder="dynamic", dtype="target")
    assert static["decoder"] == "static (eager)" and dynamic["decoder"].startswith("dynamic")
    for report in (static, dynamic):
        assert report["overall"]["identical_outputs"] == 1 and report["overall"]["cycle_plain_steps"] > 0
        assert 0 < report["overall"]["spec_prefill_seconds"] < report["overall"]["spec_seconds"]
        assert 0 < report["overall"]["target_prefill_seconds"] < report["overall"]["target_seconds"]
    assert static["overall"]["spec_tokens"] == dynamic["overall"]["spec_tokens"]


@pytest.mark.parametrize("arch", ["dflash", "dspark"])
def test_accepted_runs_rewind_and_extend_the_context_as_the_dynamic_loop(qwen3, prompts, arch, monkeypatch):
    """Drafts steered to the target's own greedy text (three of every four positions), so cycles accept
    0..D tokens: the outputs, the accepted counts and the real drafter's own drafts before steering (which
    read the context buffers the accepted runs extended) agree with the dynamic loop, cycle by cycle."""
    from dflash_train.eval import spec_decode, static_decode

    drafter, n = _drafter(qwen3, arch, 4), 30
    real_block, real_draft = spec_decode.draft_block, static_decode.StaticDecoder._draft
    for prompt in prompts:
        truth = torch.tensor(target_generate(qwen3, prompt, n + 8, []).tokens)
        p = prompt.shape[1]

        def steer(drafts, first_out):  # output index of each draft -> the truth, or a wrong token every 4th
            idx = first_out + torch.arange(drafts.shape[0])
            right = truth[idx.clamp(max=truth.numel() - 1)]
            return torch.where(idx % 4 == 3, (right + 1) % 97, right)

        seen = {"static": [], "dynamic": []}

        def dynamic_block(d, ctx, anchor, *args, **kwargs):
            drafts, q = real_block(d, ctx, anchor, *args, **kwargs)
            seen["dynamic"].append(drafts.tolist())
            return steer(drafts, ctx.length - p + 1), q

        def static_draft(self):
            drafts = real_draft(self)
            seen["static"].append(drafts.tolist())
            return steer(drafts, self.first_out)

        monkeypatch.setattr(spec_decode, "draft_block", dynamic_block)
        monkeypatch.setattr(static_decode.StaticDecoder, "_draft", static_draft)
        dynamic = speculative_generate(qwen3, drafter, qwen3.get_input_embeddings().weight,
                                       qwen3.get_output_embeddings().weight, drafter.config.target_layer_ids,
                                       prompt, n, [])
        static = _decoder(qwen3, drafter, 4, n).speculative(prompt, n, [])
        assert static.tokens == dynamic.tokens == truth[:n].tolist()
        assert static.accepted == dynamic.accepted and max(static.accepted) >= 2
        assert seen["static"] == seen["dynamic"]
