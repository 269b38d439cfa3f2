"""Speculative decoding is exact: greedy output equals the target's greedy output token for token,
and rejection sampling reproduces the target's distribution."""

import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from eval_helpers import BigramLM, tiny_drafter, tiny_target

from dflash_train.eval import spec_decode
from dflash_train.eval.spec_decode import DraftHead, accept_greedy, speculative_generate, target_generate
from dflash_train.model.target.scaling import Scaling


def _spec(target, drafter, prompt, n, eos=(), block_size=None, temperature=0.0, generator=None):
    return speculative_generate(target, drafter, target.get_input_embeddings().weight,
                                target.get_output_embeddings().weight, drafter.config.target_layer_ids, prompt, n,
                                eos, temperature=temperature, generator=generator, block_size=block_size)


def from_logits(logits_fn):
    """`draft_block` from a stand-in for the drafter's logits [D, V]: DFlash's independent draw from them."""
    from dflash_train.model.drafter.backbone import DFlashDrafter

    def block(drafter, ctx, anchor, embed_weight, head, block_size, temperature, generator=None):
        logits = logits_fn(drafter, ctx, anchor, embed_weight, head, block_size)
        return DFlashDrafter.propose(None, None, anchor, lambda rows: logits, temperature, generator)

    return block


def oracle_draft(truth: list[int], prompt_len: int, vocab: int, p_right: float, seed: int):
    """A stand-in for the drafter's logits that proposes the target's true greedy token with probability
    p_right (else a wrong one), so steps accept 0..B-1 tokens and every crop path runs."""
    gen = torch.Generator().manual_seed(seed)

    def draft(drafter, ctx, anchor, embed_weight, lm_head_weight, block_size):
        logits = torch.zeros(block_size - 1, vocab, dtype=torch.float64)
        for k in range(1, block_size):
            j = ctx.length + k - prompt_len  # index of slot k's position among generated tokens
            want = truth[j] if j < len(truth) else 0
            if torch.rand(1, generator=gen).item() >= p_right:
                want = (want + 1 + int(torch.randint(vocab - 1, (1,), generator=gen))) % vocab
            logits[k - 1, want] = 10.0
        return logits

    return draft


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target(seed=0, layers=6)  # 6 layers: two distinct z-lab taps (1, 3)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (1, n), generator=g) for n in (5, 11)]


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_equals_target_with_random_drafter(qwen3, prompts, block_size):
    drafter = tiny_drafter(qwen3.config, block_size=block_size)
    for prompt in prompts:
        plain = target_generate(qwen3, prompt, 24, [])
        spec = _spec(qwen3, drafter, prompt, 24)
        assert spec.tokens == plain.tokens and len(spec.tokens) == 24
        assert spec.block_size == block_size and len(spec.accepted) >= 1
        # an untrained drafter is (almost) never right: about one token per verification
        assert 1.0 <= spec.tau < 1.5
        for result in (plain, spec):  # the prefill's share of the wall time is measured, not assumed
            assert 0 < result.prefill_seconds < result.seconds


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_stops_at_eos_like_the_target(qwen3, prompts, block_size):
    drafter = tiny_drafter(qwen3.config, block_size=block_size)
    prompt = prompts[1]
    free = target_generate(qwen3, prompt, 24, []).tokens
    eos = free[9]  # a token the target emits; generation must stop at its first occurrence
    stop = free.index(eos)
    plain = target_generate(qwen3, prompt, 24, [eos])
    spec = _spec(qwen3, drafter, prompt, 24, eos=[eos])
    assert plain.tokens == free[: stop + 1] and plain.stopped_by_eos
    assert spec.tokens == plain.tokens and spec.stopped_by_eos
    # eos as the very first token: one token, no verification step
    first = _spec(qwen3, drafter, prompt, 24, eos=[free[0]])
    assert first.tokens == [free[0]] and first.accepted == [] and first.tau == 0.0


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_equals_target_when_drafts_are_accepted(qwen3, prompts, block_size, monkeypatch):
    """Partial and full acceptance, cache crops and bonus tokens: still the target's output."""
    drafter = tiny_drafter(qwen3.config, block_size=block_size)
    accepted = []
    for i, prompt in enumerate(prompts):
        truth = target_generate(qwen3, prompt, 40 + block_size, []).tokens
        monkeypatch.setattr(spec_decode, "draft_block", from_logits(oracle_draft(truth, prompt.shape[1], 97, 0.75, seed=i)))
        first_seen = {t: truth.index(t) for t in truth[:40]}
        eos = [max(first_seen, key=first_seen.get)]  # the token that appears last: a late stop
        spec = _spec(qwen3, drafter, prompt, 40, eos=eos)
        assert spec.tokens == target_generate(qwen3, prompt, 40, eos).tokens
        accepted += spec.accepted
    hist = Counter(accepted)
    assert sum(a + 1 for a in accepted) / len(accepted) > 1.5
    assert set(hist) == set(range(block_size)) or len(hist) >= 3, hist  # rejections, partial and full


@pytest.mark.parametrize("rows", [3, 8])  # 3: the CPU's few-row product; 8: the plain one
def test_a_draft_vocabulary_scores_only_its_rows(rows):
    """DraftHead over ids: the full head's logits on those ids, -inf on every other token, so the
    argmax is the best token of the subset and a sample never leaves it."""
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(50, 8, generator=g), torch.randn(rows + 1, 8, generator=g)
    ids = torch.tensor([1, 4, 5, 17, 30, 49])
    full = spec_decode.draft_head(hidden, weight)  # [rows, 50]
    restricted = spec_decode.draft_head(hidden, DraftHead.of(weight, ids))
    torch.testing.assert_close(restricted[:, ids], full[:, ids])
    outside = torch.ones(50, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(restricted[:, outside]).all()
    assert torch.equal(restricted.argmax(-1), ids[full[:, ids].argmax(-1)])
    assert (full.argmax(-1) != restricted.argmax(-1)).any()  # the subset changes some drafts here


def test_a_directorys_own_reduced_lm_head_drafts_as_vllm_computes_its_logits():
    """A reduced export's own lm_head rows in draft order and d2t (model/drafter/export/draft_vocab.py): the eval's
    head over them gives the logits vLLM scatters through d2t (engine_view, after qwen3_dflash.py compute_logits),
    not the target's rows at those tokens."""
    from dflash_train.model.drafter.export.engine_view import engine_draft_logits

    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(50, 8, generator=g), torch.randn(4, 8, generator=g)
    ids = torch.tensor([30, 1, 49, 4])  # draft order need not be token order
    rows = torch.randn(4, 8, generator=g)  # the directory's own rows: vLLM drafts with them
    want = engine_draft_logits(hidden, rows, ids - torch.arange(4), 50, SimpleNamespace(), {})
    torch.testing.assert_close(DraftHead.of(weight, ids, rows=rows)(hidden), want)
    assert not torch.allclose(DraftHead.of(weight, ids)(hidden)[:, ids], want[:, ids])  # the target's rows differ


def test_draft_logits_are_scaled_as_the_targets_before_the_subset_masks_the_rest():
    """A target's output_multiplier and soft cap apply to the drafter's scores too (model/target/scaling.py), inside
    a draft vocabulary as over the whole head, and the tokens outside stay -inf (tanh(-inf) would be -cap)."""
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(50, 8, generator=g), torch.randn(5, 8, generator=g) * 10
    ids = torch.tensor([1, 4, 5, 17, 30, 49])
    scaling = Scaling(1.0, 0.5, 3.0)
    want = 3.0 * torch.tanh(hidden[1:] @ weight.T * 0.5 / 3.0)  # [4, 50]
    torch.testing.assert_close(spec_decode.draft_head(hidden, weight, scaling), want)
    restricted = spec_decode.draft_head(hidden, DraftHead.of(weight, ids, scaling))
    torch.testing.assert_close(restricted[:, ids], want[:, ids])
    outside = torch.ones(50, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(restricted[:, outside]).all() and want.abs().max() <= 3.0


def test_greedy_with_a_draft_vocabulary_equals_target_and_drafts_inside_it(qwen3, prompts, monkeypatch):
    """Lossless with a draft vocabulary; every proposed token is one of its ids."""
    drafter = tiny_drafter(qwen3.config, block_size=4)
    ids = torch.arange(0, 97, 3)  # a third of the vocabulary
    drafts = []
    real_pick = spec_decode.verify_block

    def record(anchor, draft):
        drafts.extend(draft.tolist())
        return real_pick(anchor, draft)

    monkeypatch.setattr(spec_decode, "verify_block", record)
    for prompt in prompts:
        spec = speculative_generate(qwen3, drafter, qwen3.get_input_embeddings().weight,
                                    qwen3.get_output_embeddings().weight, drafter.config.target_layer_ids, prompt, 24,
                                    [], draft_vocab=ids)
        assert spec.tokens == target_generate(qwen3, prompt, 24, []).tokens
    assert drafts and set(drafts) <= set(ids.tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_top2_gaps_are_those_of_the_float32_logits(dtype):
    """`top2_gap` takes the top two before the float32 cast (no float32 copy of the verify's rows, issue 37):
    the same gaps, bitwise, as from the cast rows, ties and a row's repeated maximum included."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 500, generator=gen, dtype=torch.float64) * 4).to(dtype)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie at the top: gap 0
    logits[2] = logits[2].round()  # many ties below the top
    top = logits.float().topk(2, dim=-1).values
    assert torch.equal(spec_decode.top2_gap(logits), top[:, 0] - top[:, 1])
    assert spec_decode.top2_gap(logits)[1] == 0 and spec_decode.top2_gap(logits).dtype == torch.float32


def test_accept_greedy_by_hand():
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 5, 7, 9]):  # target argmax after slots 0..3
        logits[row, tok] = 1.0
    assert accept_greedy(torch.tensor([3, 5, 1]), logits) == (2, 7)
    assert accept_greedy(torch.tensor([0, 5, 7]), logits) == (0, 3)  # a later match does not count
    assert accept_greedy(torch.tensor([3, 5, 7]), logits) == (3, 9)  # all accepted: the bonus


def test_sampling_is_seeded_and_runs_on_qwen3(qwen3, prompts):
    drafter = tiny_drafter(qwen3.config, block_size=4)
    runs = [_spec(qwen3, drafter, prompts[0], 16, temperature=0.8, generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 16
    assert all(0 <= t < 97 for t in runs[0].tokens)
    plain = [target_generate(qwen3, prompts[0], 16, [], 0.8, torch.Generator().manual_seed(s)).tokens for s in (1, 2)]
    assert plain[0] != plain[1]  # sampling really samples


# ---------------------------------------------------------------------------------------------
# Distribution test: bigram target (exact conditionals known), vocabulary 8


class StubDrafter(torch.nn.Module):
    """Just enough drafter for `speculative_generate` when `draft_block` is replaced by a table:
    the context cache only stores the taps."""

    def __init__(self, block_size: int, mask_token_id: int):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=(0, 2),
                                      scaling=Scaling(), input_embedding_scale=1.0)
        self.dummy = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def fuse_context(self, taps):
        return taps

    def context_kv(self, ctx, positions):
        return [(ctx[:, None], ctx[:, None])]  # [b, 1, n, K*H]: what ContextCache concatenates


def table_draft(vocab: int, seed: int, subset: list[int] | None = None):
    """Draft logits from a random table indexed by (anchor, slot): far from the target's conditionals;
    with `subset`, -inf on every other token (a draft vocabulary: q is 0 there)."""
    table = torch.randn(vocab, 16, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    if subset is not None:
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[subset] = False
        table[..., outside] = float("-inf")

    def draft(drafter, ctx, anchor, embed_weight, lm_head_weight, block_size):
        return table[anchor, : block_size - 1]  # [B-1, V]

    return draft


def chain_draft(vocab: int, seed: int):
    """`draft_block` drafting a chain, as DFlash 2 and DSpark do: token i is drawn from a random table
    indexed by (the previous token, slot), so each q row is conditional on the draws before it."""
    table = torch.randn(vocab, 16, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2

    def block(drafter, ctx, anchor, embed_weight, head, block_size, temperature, generator=None):
        prev, tokens, qs = anchor, [], []
        for i in range(block_size - 1):
            q = torch.softmax(table[prev, i] / temperature, -1)
            prev = int(torch.multinomial(q, 1, generator=generator))
            tokens.append(prev)
            qs.append(q)
        return torch.tensor(tokens), torch.stack(qs)

    return block


def _chi2_critical(dof: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719 is the 1e-4 normal tail."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def _chi2(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson chi-square with cells of expected count < 5 pooled into one; returns (stat, dof)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(cell, 0), pooled_exp + e
        else:
            stat, cells = stat + (counts.get(cell, 0) - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    return stat, cells - 1


def _sample_triples(target: BigramLM, block_size: int, n: int, temperature: float) -> Counter:
    gen = torch.Generator().manual_seed(1234)
    drafter = StubDrafter(block_size, mask_token_id=7)
    prompt = torch.tensor([[2, 5]])
    counts = Counter()
    for _ in range(n):
        r = speculative_generate(target, drafter, target.embed, target.embed, (0, 2), prompt, 3, [],
                                 temperature=temperature, generator=gen, block_size=block_size)
        counts[tuple(r.tokens)] += 1
    return counts


def _exact_triples(target: BigramLM, temperature: float) -> dict:
    p1 = target.next_probs(5, temperature)
    return {(a, b, c): float(p1[a] * target.next_probs(a, temperature)[b] * target.next_probs(b, temperature)[c])
            for a in range(8) for b in range(8) for c in range(8)}


@pytest.mark.parametrize("block_size,subset,chain", [(2, None, False), (4, None, False), (4, [0, 2, 3, 5], False),
                                                     (4, None, True)])
def test_rejection_sampling_preserves_target_distribution(block_size, subset, chain, monkeypatch):
    """3 sampled tokens after a prompt: the first from the prefill, the next two through draft
    slots, rejections, corrections and (B=2) bonus tokens. Their joint must match the target's
    p(a) p(b|a) p(c|b) (chi-square at 1e-4 and total variation); the same test must reject a
    classic bug (after a rejection, resampling from p instead of the residual max(p - q, 0))."""
    temperature, n = 0.9, 2000
    target = BigramLM(vocab=8, hidden=4, num_layers=3, seed=0)
    monkeypatch.setattr(spec_decode, "draft_block",
                        chain_draft(8, seed=1) if chain else from_logits(table_draft(8, seed=1, subset=subset)))
    exact = _exact_triples(target, temperature)
    counts = _sample_triples(target, block_size, n, temperature)
    stat, dof = _chi2(counts, exact, n)
    assert stat < _chi2_critical(dof), (stat, dof)
    tv = 0.5 * sum(abs(counts.get(c, 0) / n - p) for c, p in exact.items())
    assert tv < 0.12, tv  # loose: 512 cells; the chi-square above is the sharp check

    exact_accept = spec_decode.accept_sampled

    def resample_from_p(draft, q, p, generator):
        acc, nxt = exact_accept(draft, q, p, generator)
        if acc < draft.shape[0]:  # the bug: a correction drawn from p, biased towards q's tokens
            nxt = int(torch.multinomial(p[acc], 1, generator=generator))
        return acc, nxt

    monkeypatch.setattr(spec_decode, "accept_sampled", resample_from_p)
    bad_stat, bad_dof = _chi2(_sample_triples(target, block_size, n, temperature), exact, n)
    assert bad_stat > _chi2_critical(bad_dof), (bad_stat, bad_dof)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2 target


@pytest.mark.slow
def test_greedy_equals_target_on_smollm2(smollm2_target, monkeypatch):
    t = smollm2_target
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    text = t.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = t.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    plain = target_generate(t.model, prompt, 32 + 8, [])
    drafter = tiny_drafter(t.config, block_size=2, mask_token_id=0, dtype=torch.float32, std=0.02)

    def spec(block_size):
        return speculative_generate(t.model, drafter, t.embed_weight, t.lm_head_weight,
                                    drafter.config.target_layer_ids, prompt, 32, [], block_size=block_size)

    random_drafter = spec(2)
    assert random_drafter.tokens == plain.tokens[:32]
    monkeypatch.setattr(spec_decode, "draft_block",
                        from_logits(oracle_draft(plain.tokens, prompt.shape[1], t.vocab_size, 0.8, seed=0)))
    accepting = spec(4)
    assert accepting.tokens == plain.tokens[:32]
    assert accepting.tau > 1.5


@pytest.mark.parametrize("arch", ["dflash2", "dspark"])
def test_greedy_equals_target_for_every_architecture(qwen3, prompts, arch):
    """DFlash 2's selector chain and DSpark's Markov walk (off their neutral start) stay lossless."""
    import dataclasses

    from dflash_train.model.drafter.heads.architectures import build_drafter
    from dflash_train.model.drafter.config import drafter_config_from_target

    cfg = drafter_config_from_target(qwen3.config, num_layers=1, block_size=4, mask_token_id=96, num_taps=2, arch=arch)
    drafter = build_drafter(dataclasses.replace(cfg, selector_rank=8, selector_top_k=4, markov_rank=8)).double()
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if any(k in name for k in ("codebook", "markov", "conv")):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype) * 0.3)
    for prompt in prompts:
        plain = target_generate(qwen3, prompt, 24, [])
        spec = _spec(qwen3, drafter.eval(), prompt, 24)
        assert spec.tokens == plain.tokens and max(spec.accepted) <= drafter.drafted(4)


def test_a_dspark_drafter_s_full_blocks_are_reported(qwen3, prompts, monkeypatch):
    """DSpark drafts B tokens a step, so a step may accept all B: the report (per set and overall)
    takes acceptances up to B (it used to stop at B - 1 and fail the eval after decoding)."""
    import dataclasses

    from dflash_train.eval import evaluate as ev
    from dflash_train.model.drafter.heads.architectures import build_drafter
    from dflash_train.model.drafter.config import drafter_config_from_target

    cfg = drafter_config_from_target(qwen3.config, num_layers=1, block_size=2, mask_token_id=96, num_taps=2,
                                     arch="dspark")
    drafter = build_drafter(dataclasses.replace(cfg, markov_rank=8)).double().eval()
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(0))
    truth = target_generate(qwen3, prompts[0], 12, []).tokens

    def oracle(d, ctx, anchor, embed, head, block_size, temperature, generator=None):  # always right
        start = ctx.length - prompts[0].shape[1] + 1
        return torch.tensor((truth + [0] * 4)[start:start + 2]), None

    monkeypatch.setattr(spec_decode, "draft_block", oracle)
    spec = _spec(qwen3, drafter, prompts[0], 12)
    plain = target_generate(qwen3, prompts[0], 12, [])
    report = ev._assemble({"s": ([spec], [plain])}, 2, drafter.drafted(2),
                          {"max_new_tokens": 12, "eos": set(), "temperature": 0.0}, None, 0, 1.0)
    assert max(spec.accepted) == 2 and report["overall"]["tau"] == report["sets"]["s"]["tau"] > 2
