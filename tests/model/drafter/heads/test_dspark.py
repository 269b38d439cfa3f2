"""DSpark (model/drafter/heads/dspark.py): a fresh one drafts as DFlash from every slot, its loss (Markov bias in
the softmax, TV to the target, the confidence head) equals a loop, its walk a brute-force one, and
its export is the flat format vLLM and SGLang load."""

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_train.data.anchors import drafted_targets
from dflash_train.model.drafter.export.hf_format import load_zlab, save_zlab
from dflash_train.train.loss.objective import Objective, block_loss
from dflash_train.train.loss.softmax_rows import LossMix, RowsSpec
from tests.model.drafter.heads.test_dflash2 import H, V, arch_drafter


def test_a_fresh_dspark_drafts_as_dflash_from_every_slot():
    drafter = arch_drafter("dspark", randomize=False)
    assert drafter.drafted(4) == 4 and drafter.drafted_rows(torch.zeros(1, 8, H), 4).shape == (1, 2, 4, H)
    rows = torch.randn(4, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lm_head = torch.randn(V, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    prev = torch.tensor([5, 6, 7, 8])
    assert torch.equal(drafter.greedy(rows, prev, lambda r, bias=None: r @ lm_head.T + (0 if bias is None else bias)), (rows @ lm_head.T).argmax(-1))
    ids = torch.arange(10)[None]
    labels, valid, prev = drafted_targets(ids, torch.ones(1, 10, dtype=torch.long), torch.tensor([[2]]),
                                          torch.tensor([[True]]), 4)
    assert labels.tolist() == [[[3, 4, 5, 6]]] and prev.tolist() == [[[2, 3, 4, 5]]]  # slot 0 drafts a + 1


def naive_dspark_loss(drafter, rows, lm_head, labels, valid, prev, teacher, gamma):
    """0.1 CE + 0.9 TV + 1.0 BCE(confidence, 1 - TV) per slot, logits = h L^T + W2 W1[prev], weights
    exp(-i / gamma) from the first drafted slot, normalised by their sum."""
    b, n, d = labels.shape
    num = den = 0.0
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    for i in range(b):
        for j in range(n):
            for k in range(d):
                if not valid[i, j, k]:
                    continue
                p = prev[i, j, k]
                logits = rows[i, j, k] @ lm_head.T + w2 @ w1[p]
                q = torch.softmax(logits, -1)
                target = torch.softmax(teacher[i, j, k] @ lm_head.T, -1)
                tv = 0.5 * (q - target).abs().sum()
                conf = drafter.confidence_head.proj(torch.cat([rows[i, j, k], w1[p]]))[0]
                bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach())
                loss = 0.1 * F.cross_entropy(logits[None], labels[i, j, k][None]) + 0.9 * tv + bce
                w = torch.exp(torch.tensor(-k / gamma, dtype=torch.float64))
                num, den = num + w * loss, den + w
    return num / den


def test_the_dspark_loss_equals_a_loop_in_every_parameter():
    drafter = arch_drafter("dspark", seed=3)
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(1, 2, 4, H, generator=gen, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.3
    teacher = torch.randn(1, 2, 4, H, generator=gen, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (1, 2, 4), generator=gen)
    prev = torch.randint(0, V, (1, 2, 4), generator=gen)
    valid = torch.tensor([[[True, True, True, False], [True, False, True, True]]])
    objective = Objective(RowsSpec(LossMix(ce=0.1, tv=0.9)), "decay", 3.0, 0.5, 3, False)
    stats = block_loss(rows, lm_head, labels, valid, objective, teacher, prev, head=drafter)
    got = stats.loss_sum / stats.weight_sum
    want = naive_dspark_loss(drafter, rows, lm_head, labels, valid, prev, teacher, 3.0)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    params = [rows] + [p for p in drafter.parameters() if p.ndim and any(
        p is q for q in (*drafter.markov_head.parameters(), *drafter.confidence_head.parameters()))]
    assert len(params) == 5  # rows, W1, W2, confidence weight and bias
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_the_dspark_walk_equals_a_brute_force_walk():
    drafter = arch_drafter("dspark", seed=5)
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(4, H, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.05
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    for anchor in (0, 40):
        chain, prev = [], anchor
        for i in range(4):
            prev = int((rows[i] @ lm_head.T + w2 @ w1[prev]).argmax())
            chain.append(prev)
        tokens, q = drafter.propose(rows, anchor, lambda r, bias=None: r @ lm_head.T + (0 if bias is None else bias), 0.0)
        assert q is None and tokens.tolist() == chain
    tokens, q = drafter.propose(rows, 40, lambda r, bias=None: r @ lm_head.T + (0 if bias is None else bias), 0.8, torch.Generator().manual_seed(1))
    first = torch.softmax((rows[0] @ lm_head.T + w2 @ w1[40]).double() / 0.8, -1)
    torch.testing.assert_close(q[0], first)  # each row the conditional of the token drawn before it
    second = torch.softmax((rows[1] @ lm_head.T + w2 @ w1[int(tokens[0])]).double() / 0.8, -1)
    torch.testing.assert_close(q[1], second)


def test_export_is_the_flat_format_both_engines_load(tmp_path):
    drafter = arch_drafter("dspark").float()
    out = save_zlab(drafter, tmp_path / "ds", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    for key, value in (("markov_rank", 8), ("markov_head_type", "vanilla"), ("sample_from_anchor", True),
                       ("enable_confidence_head", True), ("confidence_head_with_markov", True)):
        assert config[key] == value and key not in config["dflash_config"]  # where vLLM and SGLang read them
    assert config["mask_token_id"] == config["dflash_config"]["mask_token_id"]
    loaded = load_zlab(out)
    assert loaded.config == drafter.config and type(loaded) is type(drafter)
    shapes = {k: tuple(v.shape) for k, v in loaded.state_dict().items()}
    assert shapes["markov_head.markov_w1.weight"] == (V, 8) and shapes["markov_head.markov_w2.weight"] == (V, 8)
    assert shapes["confidence_head.proj.weight"] == (1, H + 8) and shapes["confidence_head.proj.bias"] == (1,)
    config["markov_head_type"] = "rnn"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="markov_head_type"):
        load_zlab(out)
