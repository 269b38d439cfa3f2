"""DFlash 2 (model/drafter/heads/dflash2.py): identity at initialisation, convolutions inside blocks only, the
training layout equal to drafting, the selector's chain against a brute-force walk, its loss against
a loop, and the export round trip in the engines' names."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dflash_train.data.anchors import block_inputs, position_ids
from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.drafter.attention import MaskSpec, build_training_masks
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import ContextCache
from dflash_train.model.drafter.export.hf_format import load_zlab, save_zlab
from dflash_train.train.loss.softmax_rows import RowsSpec, linear_softmax_loss
from tests.model.drafter.test_backbone import tiny_target_config

H, V, MASK = 64, 97, 96


def arch_drafter(arch: str, seed=0, block=4, layers=2, window=None, randomize=True):
    """A float64 drafter of `arch` for the tiny target; `randomize` moves every architecture parameter
    off its neutral initialisation (convolutions, codebooks, Markov bias), so each one matters."""
    cfg = drafter_config_from_target(tiny_target_config(), num_layers=layers, block_size=block, mask_token_id=MASK,
                                     num_taps=3, sliding_window=window, arch=arch)
    cfg = dataclasses.replace(cfg, selector_rank=8, selector_top_k=5, markov_rank=8)
    drafter = build_drafter(cfg).double()
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(seed))
    if randomize:
        gen = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if any(k in name for k in ("conv", "codebook", "markov", "confidence", "hidden_projection")):
                    p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return drafter


def training_inputs(seed=3, S=30, B=4, anchors=((1, 9, 17, 28),), window=None):
    gen = torch.Generator().manual_seed(seed)
    taps = torch.randn(1, S, 3 * H, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, MASK, (1, S), generator=gen)
    embed = torch.randn(V, H, generator=gen, dtype=torch.float64)
    anchors = torch.tensor(anchors)
    keep = torch.ones_like(anchors, dtype=torch.bool)
    masks = build_training_masks(MaskSpec(S, B, anchors.shape[1], window), ("full_attention", "sliding_attention"),
                                 anchors, keep, "sdpa")
    return taps, ids, embed, anchors, masks


def test_a_fresh_dflash2_is_dflash1():
    """Identity convolutions and a zero successor codebook: with DFlash 1's weights the hidden states,
    and so the unary logits and the greedy selector's choice, are DFlash 1's."""
    d2 = arch_drafter("dflash2", randomize=False)
    d1 = build_drafter(dataclasses.replace(d2.config, arch="dflash")).double()
    missing = d1.load_state_dict(d2.state_dict(), strict=False)
    assert not missing.missing_keys
    taps, ids, embed, anchors, masks = training_inputs()
    blocks = embed[block_inputs(ids, anchors, 4, MASK)]
    pos = position_ids(30, anchors, 4)
    out1, out2 = d1(blocks, taps, pos, masks, "sdpa"), d2(blocks, taps, pos, masks, "sdpa")
    torch.testing.assert_close(out2, out1, rtol=0, atol=0)
    rows = out2[0, 1:4]  # block 0's drafting slots
    lm_head = torch.randn(V, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    prev = torch.tensor([3, 4, 5])
    assert torch.equal(d2.greedy(rows, prev, lambda r: r @ lm_head.T), (rows @ lm_head.T).argmax(-1))
    assert any(p.abs().sum() > 0 for n, p in d2.named_parameters() if "conv" in n)  # not all-zero modules


def test_convolution_taps_never_cross_a_block_boundary():
    """Perturbing one block's input changes no other block's output (the convolutions shift inside
    each block of the concatenated training layout, never into the next)."""
    drafter = arch_drafter("dflash2")
    taps, ids, embed, anchors, masks = training_inputs(anchors=((3, 4, 20, 25),))  # overlapping anchors too
    blocks = embed[block_inputs(ids, anchors, 4, MASK)]
    pos = position_ids(30, anchors, 4)
    base = drafter(blocks, taps, pos, masks, "sdpa")
    moved = blocks.clone()
    moved[:, 4:8] += 1.0  # block 1
    out = drafter(moved, taps, pos, masks, "sdpa")
    changed = (out - base).abs().amax(-1)[0].view(4, 4).amax(-1)  # per block
    assert changed[1] > 1e-3 and torch.equal(changed[[0, 2, 3]], torch.zeros(3, dtype=changed.dtype))


@pytest.mark.parametrize("window", [None, 6])
def test_training_layout_equals_drafting_with_convolutions(window):
    """Each training block equals a real draft step of that block alone (context cache before the
    anchor), with non-identity convolutions and a window."""
    drafter = arch_drafter("dflash2", window=window)
    taps, ids, embed, anchors, masks = training_inputs(window=window)
    blocks = embed[block_inputs(ids, anchors, 4, MASK)]
    out = drafter(blocks, taps, position_ids(30, anchors, 4), masks, "sdpa")
    for j, a in enumerate(anchors[0].tolist()):
        cache = ContextCache()
        cache.append(drafter, taps[:, :a])
        draft = drafter.draft(blocks[:, j * 4:(j + 1) * 4], cache, torch.arange(a, a + 4)[None])
        torch.testing.assert_close(out[:, j * 4:(j + 1) * 4], draft, atol=1e-10, rtol=1e-10)


def brute_force_chain(drafter, rows, anchor, logits):
    """The selector walk as loops: for each slot, every candidate's score written as a sum over rank
    components with explicit indices; the predecessor the previous choice."""
    sel = drafter.candidate_selector
    k = sel.top_k
    chain, prev = [], anchor
    for i in range(rows.shape[0]):
        order = sorted(range(logits.shape[1]), key=lambda v: -float(logits[i, v]))[:k]
        projected = [float(sum(sel.hidden_projection.weight[r, c] * rows[i, c] for c in range(rows.shape[1])))
                     for r in range(sel.hidden_projection.weight.shape[0])]
        best, best_score = None, -float("inf")
        for c in order:
            score = float(logits[i, c]) + sum(float(sel.predecessor_codebook[prev, r]) * projected[r]
                                              * float(sel.successor_codebook[c, r]) for r in range(len(projected)))
            if score > best_score:
                best, best_score = c, score
        chain.append(best)
        prev = best
    return chain


def test_the_selector_walks_the_chain_of_a_brute_force_walk():
    drafter = arch_drafter("dflash2", seed=5)
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(3, H, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.02  # unary gaps the selector can bridge
    logits_fn = lambda r: r @ lm_head.T  # noqa: E731
    for anchor in (0, 17, 95):
        tokens, q = drafter.propose(rows, anchor, logits_fn, temperature=0.0)
        assert q is None and tokens.tolist() == brute_force_chain(drafter, rows, anchor, logits_fn(rows))
    # the chain depends on its start: a selector that ignored the predecessor would give one chain
    assert len({tuple(drafter.propose(rows, a, logits_fn, 0.0)[0].tolist()) for a in range(20)}) > 1
    tokens, q = drafter.propose(rows, 7, logits_fn, temperature=0.7, generator=torch.Generator().manual_seed(1))
    top = logits_fn(rows).topk(5, -1).indices
    for i in range(3):  # each row a distribution over that slot's candidates, the drawn token among them
        assert q[i].sum().item() == pytest.approx(1.0) and set(q[i].nonzero()[:, 0].tolist()) <= set(top[i].tolist())
        assert q[i, tokens[i]] > 0


def naive_selector_loss(drafter, rows, logits, labels, prev, k):
    """Per row: the k-way CE over the top-k, the gold token replacing rank k when it is outside."""
    sel, losses = drafter.candidate_selector, []
    for t in range(rows.shape[0]):
        cand = logits[t].topk(k).indices.tolist()
        if int(labels[t]) not in cand:
            cand[-1] = int(labels[t])
        query = sel.predecessor_codebook[prev[t]] * sel.hidden_projection(rows[t])
        scores = torch.stack([logits[t, c].detach() + (query * sel.successor_codebook[c]).sum() for c in cand])
        losses.append(F.cross_entropy(scores[None], torch.tensor([cand.index(int(labels[t]))]), reduction="none")[0])
    return torch.stack(losses)


def test_the_selector_loss_equals_a_loop_and_trains_the_codebooks():
    drafter = arch_drafter("dflash2", seed=7)
    gen = torch.Generator().manual_seed(8)
    rows = torch.randn(9, H, generator=gen, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(V, H, generator=gen, dtype=torch.float64)
    logits = (rows @ lm_head.T).detach()
    labels = torch.cat([logits[:5].argmax(-1), logits[5:].argmin(-1)])  # inside the top-k, and outside it
    prev = torch.randint(0, V, (9,), generator=gen)
    out = linear_softmax_loss(rows, lm_head, labels, chunk=4, spec=RowsSpec(topk=5))
    got, predicted = drafter.extra_loss(rows, out, labels, prev, None, weight=1.0, has_tv=False)
    want = naive_selector_loss(drafter, rows, logits, labels, prev, 5)
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10)
    params = [rows, drafter.candidate_selector.successor_codebook, drafter.candidate_selector.predecessor_codebook]
    for a, b in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    greedy = drafter.greedy(rows.detach(), prev, lambda r: r @ lm_head.T)
    assert torch.equal(predicted, greedy)  # training's accuracy is the drafting rule's


def test_export_round_trip_in_the_engines_names(tmp_path):
    drafter = arch_drafter("dflash2").float()
    out = save_zlab(drafter, tmp_path / "d2", dtype=torch.float32)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= names
    assert len(names) == 15 * 2 + 3 + 3  # per layer 11 + 4 conv tensors; fc, norms; selector
    loaded = load_zlab(out)
    assert loaded.config == drafter.config and type(loaded) is type(drafter)
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    import json

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                    "selector_top_k")} == {"conv_kernel_size": 2,
                                                                           "conv_group_size": 16,
                                                                           "selector_rank": 8, "selector_top_k": 5}
