"""The simulated decode walk against real speculative decoding: in float64, on the text the real loop
produced, the walk must reproduce the loop's accepted count at every step."""

import dataclasses

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train.eval.spec_decode import speculative_generate
from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.target.target import Target
from dflash_train.train.watch import simulate
from dflash_train.train.watch.simulate import accepted_walk, simulated_walks, simulator
from dflash_train.train.step import StepContext

LIKELY = [3, 5, 7]  # the only tokens with a large lm_head row: drafts are right about a third of the time


def _peaked_target() -> Target:
    """A tiny random float64 Qwen3 whose lm_head favours three tokens, so its greedy text and a random
    drafter's guesses share them and acceptance varies from step to step (0 to B-1)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=97, tie_word_embeddings=False,
                      attn_implementation="eager")
    model = Qwen3ForCausalLM(cfg).to(torch.float64).eval().requires_grad_(False)
    head = model.get_output_embeddings().weight
    head.mul_(0.01)
    head[LIKELY] *= 300.0
    return Target(model=model, tokenizer=None, name="peaked")


def _drafter(target: Target, block_size: int, arch: str = "dflash") -> DFlashDrafter:
    cfg = drafter_config_from_target(target.config, num_layers=1, block_size=block_size, mask_token_id=96, num_taps=2,
                                     arch=arch)
    drafter = build_drafter(dataclasses.replace(cfg, selector_rank=8, selector_top_k=4, markov_rank=8)).to(torch.float64)
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # the previous-token heads off their neutral start, so they steer the drafts
        for name, p in drafter.named_parameters():
            if any(k in name for k in ("codebook", "markov_w1", "hidden_projection")):
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            if "markov_w2" in name:  # a bias that picks among the likely tokens by the previous one
                p[LIKELY] = torch.randn(len(LIKELY), p.shape[1], generator=gen, dtype=p.dtype) * 3.0
    return drafter.eval()


def _ctx(target: Target, drafter: DFlashDrafter) -> StepContext:
    return StepContext(embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight, drafter=drafter.config,
                       gamma=1.0, chunk_tokens=256, backend="sdpa", device=torch.device("cpu"), autocast_dtype=None,
                       head=drafter)


def test_accepted_walk_by_hand():
    anchors, accepted = [4, 5, 6, 7, 8, 9], [2, 0, 1, 3, 0, 1]
    assert accepted_walk(anchors, accepted, start=4) == [2, 3]  # 4 -> 7 -> 11 (no anchor: stop)
    assert accepted_walk(anchors, accepted, start=5) == [0, 1, 0, 1]  # 5 -> 6 -> 8 -> 9 -> 11
    assert accepted_walk(anchors, accepted, start=20) == []


WITHOUT_5 = torch.tensor([i for i in range(97) if i != 5])  # a draft vocabulary without a likely token


@pytest.mark.parametrize("block_size,draft_vocab,arch", [(3, None, "dflash"), (4, None, "dflash"),
                                                         (4, WITHOUT_5, "dflash"), (4, None, "dflash2"),
                                                         (4, WITHOUT_5, "dflash2"), (4, None, "dspark")])
def test_walk_reproduces_real_speculative_decoding(block_size, draft_vocab, arch):
    """Also with a draft vocabulary: the walk must draft over it as the loop does (over the full
    head the walk would propose token 5 where the loop cannot); and for the architectures whose
    drafts depend on the previous token (the walk teacher-forces it, the loop feeds its own drafts:
    equal along every accepted run)."""
    target = _peaked_target()
    drafter = _drafter(target, block_size, arch)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 90, (1, n), generator=g) for n in (6, 9, 13)]
    real = [speculative_generate(target.model, drafter, target.embed_weight, target.lm_head_weight,
                                 drafter.config.target_layer_ids, p, 40, [], draft_vocab=draft_vocab) for p in prompts]
    steps = [a for r in real for a in r.accepted]
    assert len(set(steps)) >= (2 if arch == "dspark" else 3), f"the test needs uneven acceptance, got {steps}"
    pairs = [(p[0].tolist(), r.tokens) for p, r in zip(prompts, real)]
    walks, per_anchor = simulated_walks(drafter, target, _ctx(target, drafter), pairs, draft_vocab)
    for walk, r in zip(walks, real):
        # the last real step may have accepted drafts past the text's end, which the walk cannot see
        assert walk[:-1] == r.accepted[:-1] and len(walk) == len(r.accepted)
        assert walk[-1] <= r.accepted[-1]
    figures = simulator(drafter, target, _ctx(target, drafter), draft_vocab)(pairs)
    assert len(simulate._groups([(i, p, o) for i, (p, o) in enumerate(pairs)], simulate.SIM_BATCH_TOKENS)) == 1
    walk_steps = [a for w in walks for a in w]
    assert figures["sim_tau"] == pytest.approx(sum(a + 1 for a in walk_steps) / len(walk_steps))
    assert figures["sim_tau_anchors"] == pytest.approx(per_anchor) and 1.0 <= per_anchor <= block_size + 1


@pytest.mark.parametrize("arch", ["dflash2", "dspark"])
def test_batched_walks_equal_one_sequence_at_a_time(arch, monkeypatch):
    """The walks' batches (right-padded to their longest text) give what one sequence at a time gives, to the
    count, in float64; a sequence too short to draft keeps its empty walk and its place."""
    target = _peaked_target()
    drafter = _drafter(target, 4, arch)
    g = torch.Generator().manual_seed(3)
    pairs = [(torch.randint(0, 90, (n,), generator=g).tolist(),
              [LIKELY[i % 3] if i % 2 else int(t) for i, t in enumerate(torch.randint(0, 90, (m,), generator=g))])
             for n, m in ((5, 30), (12, 1), (3, 41), (9, 17))]
    batched = simulated_walks(drafter, target, _ctx(target, drafter), pairs)
    monkeypatch.setattr(simulate, "SIM_BATCH_TOKENS", 1)  # every sequence alone
    alone = simulated_walks(drafter, target, _ctx(target, drafter), pairs)
    assert batched[0] == alone[0] and batched[0][1] == [] and all(batched[0][i] for i in (0, 2, 3))
    assert batched[1] == pytest.approx(alone[1])


def test_groups_keep_the_padded_budget():
    items = [(i, [0] * p, [1] * o) for i, (p, o) in enumerate([(10, 20), (5, 5), (40, 60), (1, 1), (200, 300)])]
    groups = simulate._groups(items, 120)  # lengths 30, 10, 100, 2, 500
    assert [[i for i, _, _ in g] for g in groups] == [[0, 1], [2], [3], [4]]  # 3 x 100 > 120; 2 x 100 > 120
    assert simulate._groups(items[:2], 60) == [items[:2]]
    assert simulate._groups(items[:2], 59) == [[items[0]], [items[1]]]


@pytest.mark.parametrize("arch", ["dflash", "dspark"])
def test_the_confidence_head_is_scored_on_the_walks_text(arch):
    """A drafter with a confidence head gets its calibration in the simulator's figures; its first slot's
    outcome is the anchor's own acceptance (accepted >= 1), one pair per anchor with a label. DFlash has no head."""
    from dflash_train.eval.calibration import Calibration
    from dflash_train.train import setup
    from dflash_train.train.feed.batching import to_device
    from dflash_train.train.feed.taps import target_tensors, taps_spec
    from dflash_train.data.records import Sample
    from dflash_train.train.watch.simulate import anchor_acceptance, eval_context

    target = _peaked_target()
    drafter = _drafter(target, 4, arch)
    g = torch.Generator().manual_seed(5)
    prompt, out = torch.randint(0, 90, (7,), generator=g).tolist(), torch.randint(0, 90, (30,), generator=g).tolist()
    out = [LIKELY[i % 3] if i % 2 else t for i, t in enumerate(out)]  # some drafts land
    figures = simulator(drafter, target, _ctx(target, drafter))([(prompt, out)])
    assert ("confidence" in figures) == (arch == "dspark")
    if arch == "dflash":
        return
    sample = Sample("t", tuple(prompt + out), (0,) * len(prompt) + (1,) * len(out))
    (mb,) = setup.eval_batches([sample], len(sample), 1, len(sample), max_samples=1)
    mb.from_target = target_tensors(target, list(drafter.config.target_layer_ids), mb, torch.device("cpu"),
                                    taps_spec(drafter.config, target.dtype))
    cal = Calibration()
    with torch.no_grad():
        accepted, has_label = anchor_acceptance(drafter, to_device(mb, torch.device("cpu")),
                                                eval_context(_ctx(target, drafter)), None, cal)
    first_slot = cal.summary()["per_slot"][0]
    assert first_slot[2] == int(has_label.sum())
    assert first_slot[1] == pytest.approx(float((accepted[has_label] >= 1).double().mean()))
    assert 0 < figures["confidence"]["pairs"] and figures["confidence"]["per_slot"][0][2] == first_slot[2]
