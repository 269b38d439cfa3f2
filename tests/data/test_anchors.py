import pytest
import torch

from dflash_train.data.anchors import (all_anchors, anchor_generator, block_inputs, block_labels, eligible_anchors,
                                       position_ids, sample_anchors)


def test_eligible_needs_both_positions_supervised():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1, 1])
    assert eligible_anchors(mask).tolist() == [1, 2, 7]


def test_sample_anchors_sorted_padded_and_reseeded_per_epoch():
    mask = torch.zeros(200, dtype=torch.long)
    mask[50:190] = 1
    a0, k0 = sample_anchors(mask, 32, anchor_generator(0, 0, "s1"))
    a0b, _ = sample_anchors(mask, 32, anchor_generator(0, 0, "s1"))
    a1, _ = sample_anchors(mask, 32, anchor_generator(0, 1, "s1"))
    assert torch.equal(a0, a0b) and not torch.equal(a0, a1)  # same draw per (seed, epoch, id)
    assert k0.all() and torch.equal(a0, a0.sort().values) and len(set(a0.tolist())) == 32
    assert all(mask[a] and mask[a + 1] for a in a0.tolist())
    few, keep = sample_anchors(mask[:55], 32, anchor_generator(0, 0, "s2"))  # 4 eligible: 50..53
    assert keep.sum() == 4 and few[:4].tolist() == [50, 51, 52, 53] and few[4:].eq(0).all()


def test_all_anchors_is_deterministic_and_covers_the_range():
    mask = torch.ones(100, dtype=torch.long)
    anchors, keep = all_anchors(mask, 10)
    assert keep.all() and anchors[0] == 0 and anchors[-1] == 98


def test_block_tensors():
    ids = torch.arange(100, 110)[None]  # tokens 100..109
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1]])
    anchors, keep = torch.tensor([[2, 8]]), torch.tensor([[True, True]])
    assert block_inputs(ids, anchors, 3, mask_token_id=7).tolist() == [[102, 7, 7, 108, 7, 7]]
    assert position_ids(10, anchors, 3)[0, 10:].tolist() == [2, 3, 4, 8, 9, 10]
    labels, valid = block_labels(ids, mask, anchors, keep, 3)
    assert labels[0, 0].tolist() == [102, 103, 104]
    assert valid[0, 0].tolist() == [False, True, True]  # slot 0 is never a target
    assert valid[0, 1].tolist() == [False, True, False]  # position 10 is past the end


def test_pitfall_2_no_document_is_starved_of_anchors_and_coverage_is_reported():
    """Published pitfall 2 (speculators #1071): anchors drawn per packed row starve short documents.
    Each of our sequences is one document drawing min(N, eligible) anchors: a short document gets
    every eligible position, a long one N, and `anchor_coverage` reports exactly that."""
    from dflash_train.data.anchors import anchor_coverage

    n = 8
    masks = [torch.tensor([0] * 5 + [1] * k) for k in (3, 6, 40)]  # 2, 5 and 39 eligible positions
    for mask in masks:
        anchors, keep = sample_anchors(mask, n, torch.Generator().manual_seed(0))
        eligible = eligible_anchors(mask)
        assert int(keep.sum()) == min(n, eligible.numel())
        if eligible.numel() <= n:  # short: every eligible position anchored
            assert set(anchors[keep].tolist()) == set(eligible.tolist())
    c = anchor_coverage(masks, n)
    assert c["documents"] == 3 and c["capped"] == 1 and c["starved"] == 0
    assert c["min"] == pytest.approx(8 / 40) and c["median"] == pytest.approx(2 / 3)  # 2/3, 5/6, 8/40
