"""Domino (model/drafter/heads/domino.py): slots 0..B-2 draft, a fresh one is its backbone, the GRU is the published
cell, its loss (the correction in the softmax, the lambda curriculum) equals a loop in value and in
every gradient, its walk a brute-force one written from SGLang's rollout, and its export is what
SGLang's DFlash drafter loads. (Lossless decoding, the teacher-forced walk against real decoding, the
plan count, Muon's split, check and the two-rank resume run for every head: tests/model/drafter/heads/test_heads.py,
tests/train/test_pipeline.py.)"""

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_train.data.anchors import drafted_targets
from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.export.hf_format import load_zlab, save_zlab
from dflash_train.model.drafter.export.serve import serve_instructions
from dflash_train.train.loss.objective import Objective, block_loss
from dflash_train.train.loss.softmax_rows import RowsSpec
from tests.model.drafter.test_backbone import tiny_target_config

H, V, G, E = 64, 97, 12, 6


def domino(seed: int = 0, block: int = 4, randomize: bool = True, **settings):
    cfg = drafter_config_from_target(tiny_target_config(), num_layers=1, block_size=block, mask_token_id=96,
                                     num_taps=3, arch="domino",
                                     head_settings={"domino_gru_dim": G, "domino_emb_dim": E, **settings})
    drafter = build_drafter(cfg).double()
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(seed))
    if randomize:  # the correction off its zero start
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in [*drafter.prefix_gru.parameters(), *drafter.embed_proj.parameters()]:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return drafter


def gru_states(drafter, embeds: torch.Tensor) -> torch.Tensor:
    """States [n, G] after each of embeds [n, H], from the cell's equations (SGLang's domino_helper):
    r, z = sigmoid(W_ir x + W_hr h), sigmoid(W_iz x + W_hz h); n = tanh(W_in x + r W_hn h);
    h = (1 - z) n + z h, from h = 0."""
    w_ih, w_hh = drafter.prefix_gru.weight_ih_l0, drafter.prefix_gru.weight_hh_l0
    h, out = torch.zeros(G, dtype=embeds.dtype), []
    for x in embeds:
        gi, gh = w_ih @ x, w_hh @ h
        r, z = torch.sigmoid(gi[:G] + gh[:G]), torch.sigmoid(gi[G:2 * G] + gh[G:2 * G])
        n = torch.tanh(gi[2 * G:] + r * gh[2 * G:])
        h = (1 - z) * n + z * h
        out.append(h)
    return torch.stack(out)


def correction(drafter, row: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """W2 silu(W1 [h; g]) [V]."""
    w1, w2 = drafter.embed_proj[0].weight, drafter.embed_proj[2].weight
    return w2 @ F.silu(w1 @ torch.cat([row, state]))


def test_slots_0_to_b_minus_2_draft_and_a_fresh_domino_is_its_backbone():
    drafter = domino(randomize=False)
    assert drafter.drafted(4) == 3 and drafter.drafted_offset == 0
    hidden = torch.arange(8.0)[None, :, None].expand(1, 8, H)  # slot value = its index
    assert drafter.drafted_rows(hidden, 4)[0, :, :, 0].tolist() == [[0, 1, 2], [4, 5, 6]]
    ids = torch.arange(10)[None]
    labels, _, prev = drafted_targets(ids, torch.ones(1, 10, dtype=torch.long), torch.tensor([[2]]),
                                      torch.tensor([[True]]), drafter.drafted(4))
    assert labels.tolist() == [[[3, 4, 5]]] and prev.tolist() == [[[2, 3, 4]]]  # slot 0 drafts a + 1
    gen = torch.Generator().manual_seed(1)
    rows, lm_head = torch.randn(2, 3, H, generator=gen, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64)
    table = torch.randn(V, H, generator=gen, dtype=torch.float64)
    fn = lambda r, bias=None: r @ lm_head.T + (0 if bias is None else bias)  # noqa: E731
    greedy = drafter.greedy(rows, prev[0].expand(2, 3), fn, lambda i: table[i])
    assert torch.equal(greedy, (rows @ lm_head.T).argmax(-1))


def test_the_gru_is_the_published_cell():
    drafter = domino(seed=2)
    embeds = torch.randn(5, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close(drafter.prefix_gru(embeds[None])[0][0], gru_states(drafter, embeds))


def naive_domino_loss(drafter, rows, lm_head, table, labels, valid, prev, gamma, lam):
    """(1 - lam) CE(corrected) + lam CE(backbone) per row, correction from slot 1 on, decay weights
    exp(-i / gamma), normalised by their sum."""
    b, n, d = labels.shape
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            states = gru_states(drafter, table[prev[i, j]])  # [D, G]: after x_0 .. x_s
            for k in range(d):
                if not valid[i, j, k]:
                    continue
                base = rows[i, j, k] @ lm_head.T
                final = base + (correction(drafter, rows[i, j, k], states[k]) if k >= 1 else 0)
                loss = ((1 - lam) * F.cross_entropy(final[None], labels[i, j, k][None])
                        + lam * F.cross_entropy(base[None], labels[i, j, k][None]))
                w = torch.exp(torch.tensor(-k / gamma, dtype=torch.float64))
                num, den = num + w * loss, den + w
    return num / den


@pytest.mark.parametrize("progress,lam", [(0.0, 0.8), (0.25, 0.4), (0.5, 0.0), (0.9, 0.0)])
def test_the_domino_loss_and_its_curriculum_equal_a_loop_in_every_parameter(progress, lam):
    drafter = domino(seed=3, domino_lambda_start=0.8, domino_lambda_decay=0.5)
    assert drafter.lambda_at(progress) == pytest.approx(lam)
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(1, 2, 3, H, generator=gen, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.3
    table = torch.randn(V, H, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (1, 2, 3), generator=gen)
    prev = torch.randint(0, V, (1, 2, 3), generator=gen)
    valid = torch.tensor([[[True, True, False], [True, False, True]]])
    objective = Objective(RowsSpec(), "decay", 3.0, 0.5, 4, False)
    stats = block_loss(rows, lm_head, labels, valid, objective, None, prev, drafter, embed=lambda ids: table[ids],
                       progress=progress)
    got = stats.loss_sum / stats.weight_sum
    want = naive_domino_loss(drafter, rows, lm_head, table, labels, valid, prev, 3.0, lam)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    params = [rows, drafter.prefix_gru.weight_ih_l0, drafter.prefix_gru.weight_hh_l0,
              drafter.embed_proj[0].weight, drafter.embed_proj[2].weight]
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_the_walk_equals_a_brute_force_walk_from_sglangs_rollout():
    """SGLang's rollout: slot 0 from the backbone, the GRU over [anchor, first draft], then each slot
    corrected and the GRU stepped with its draft; at T > 0 each row the corrected distribution."""
    drafter = domino(seed=5)
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(3, H, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.05
    table = torch.randn(V, H, generator=gen, dtype=torch.float64)
    fn = lambda r, bias=None: r @ lm_head.T + (0 if bias is None else bias)  # noqa: E731
    for anchor in (0, 40):
        chain = [int((rows[0] @ lm_head.T).argmax())]
        for i in (1, 2):
            state = gru_states(drafter, table[torch.tensor([anchor] + chain)])[-1]
            chain.append(int((rows[i] @ lm_head.T + correction(drafter, rows[i], state)).argmax()))
        tokens, q = drafter.propose(rows, anchor, fn, 0.0, embed=lambda ids: table[ids])
        assert q is None and tokens.tolist() == chain
        prev = torch.tensor([[anchor] + chain[:2]])
        assert drafter.greedy(rows[None], prev, fn, lambda ids: table[ids])[0].tolist() == chain  # teacher forced
    tokens, q = drafter.propose(rows, 40, fn, 0.8, torch.Generator().manual_seed(1), embed=lambda ids: table[ids])
    torch.testing.assert_close(q[0], torch.softmax(rows[0] @ lm_head.T / 0.8, -1))
    state = gru_states(drafter, table[torch.tensor([40, int(tokens[0])])])[-1]
    torch.testing.assert_close(q[1], torch.softmax((rows[1] @ lm_head.T + correction(drafter, rows[1], state)) / 0.8,
                                                   -1))


def test_the_export_is_what_sglang_s_dflash_drafter_loads(tmp_path):
    drafter = domino().float()
    out = save_zlab(drafter, tmp_path / "domino", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert {k: config["dflash_config"][k] for k in ("projector_type", "shift_label", "pure_draft_prefix_len",
                                                    "gru_hidden_dim", "emb_dim")} == {
        "projector_type": "domino", "shift_label": True, "pure_draft_prefix_len": 1, "gru_hidden_dim": G, "emb_dim": E}
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items() if not k.startswith(("layers.", "fc", "norm",
                                                                                                "hidden_norm"))}
    assert shapes == {"prefix_gru.weight_ih_l0": (3 * G, H), "prefix_gru.weight_hh_l0": (3 * G, G),
                      "embed_proj.0.weight": (E, H + G), "embed_proj.2.weight": (V, E)}
    text = serve_instructions(out)
    assert ("--speculative-algorithm DFLASH" in text and "--speculative-num-draft-tokens 4 " in text
            and "--speculative-domino-candidate-pool-size 0" in text and "vLLM:   not served" in text)
    loaded = load_zlab(out)
    assert type(loaded) is type(drafter) and loaded.config == drafter.config
    config["architectures"], config["emb_dim"] = ["DominoDraftModel"], E  # SpecForge's own export
    (out / "config.json").write_text(json.dumps(config))
    assert load_zlab(out).config == drafter.config
    config["dflash_config"]["shift_label"] = False  # SpecForge's other layout: not this trainer's
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="shift_label=False, but this trainer's domino drafter is shift_label=True"):
        load_zlab(out)
    config["dflash_config"].pop("projector_type")  # a plain DFlash config over Domino weights
    config["architectures"] = ["DFlashDraftModel"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weights do not match the config .*unexpected.*embed_proj"):
        load_zlab(out)
