"""DSpark's Markov head forms (model/drafter/heads/dspark.py, `drafter.markov_head_type`): the gated and rnn biases,
written out as loops from SGLang's and speculators' definitions, equal the loss the trainer computes,
in value and in every gradient; their export carries the form where the engines read it, and says
that vLLM serves only the vanilla form. (Every head's export, check, plan count, lossless decoding and
teacher-forced walk run for these forms too: tests/model/drafter/heads/test_heads.py.)"""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.export.hf_format import save_zlab
from dflash_train.model.drafter.export.serve import engine_notes, serve_instructions
from dflash_train.train.loss.objective import Objective, block_loss
from dflash_train.train.loss.softmax_rows import LossMix, RowsSpec
from tests.model.drafter.test_backbone import tiny_target_config

H, V, R = 64, 97, 8


def markov_drafter(kind: str, seed: int = 0):
    cfg = drafter_config_from_target(tiny_target_config(), num_layers=1, block_size=4, mask_token_id=96, num_taps=3,
                                     arch="dspark", head_settings={"markov_rank": R, "markov_head_type": kind})
    drafter = build_drafter(cfg).double()
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in [*drafter.markov_head.parameters(), *drafter.confidence_head.parameters()]:
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return drafter


def naive_latents(drafter, rows, prev):
    """m [D, r] of one block, slot by slot from the module doc's formulas (SGLang's step_bias)."""
    head = drafter.markov_head
    w1 = head.markov_w1.weight
    state, out = torch.zeros(R, dtype=rows.dtype), []
    for k in range(rows.shape[0]):
        e = w1[prev[k]]
        if head.kind == "gated":
            gate = torch.sigmoid(head.gate_proj.weight @ torch.cat([rows[k], e]) + head.gate_proj.bias)
            out.append(gate * e)
        else:
            a, c, o = (head.joint_proj.weight @ torch.cat([state, e, rows[k]]) + head.joint_proj.bias).split(R)
            out.append(torch.tanh(o))
            state = torch.sigmoid(a) * state + (1 - torch.sigmoid(a)) * torch.tanh(c)
    return torch.stack(out)


def naive_loss(drafter, rows, lm_head, labels, valid, prev, teacher, gamma):
    """0.1 CE + 0.9 TV + 1.0 BCE(confidence, 1 - TV) per slot, logits = h L^T + W2 m, weights exp(-i/gamma)."""
    b, n, d = labels.shape
    num = den = 0.0
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    for i in range(b):
        for j in range(n):
            latents = naive_latents(drafter, rows[i, j], prev[i, j])
            for k in range(d):
                if not valid[i, j, k]:
                    continue
                logits = rows[i, j, k] @ lm_head.T + w2 @ latents[k]
                q = torch.softmax(logits, -1)
                tv = 0.5 * (q - torch.softmax(teacher[i, j, k] @ lm_head.T, -1)).abs().sum()
                conf = drafter.confidence_head.proj(torch.cat([rows[i, j, k], w1[prev[i, j, k]]]))[0]
                loss = (0.1 * F.cross_entropy(logits[None], labels[i, j, k][None]) + 0.9 * tv
                        + F.binary_cross_entropy_with_logits(conf, (1 - tv).detach()))
                w = torch.exp(torch.tensor(-k / gamma, dtype=torch.float64))
                num, den = num + w * loss, den + w
    return num / den


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_the_markov_forms_loss_equals_a_loop_in_every_parameter(kind):
    drafter = markov_drafter(kind, seed=3)
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
    want = naive_loss(drafter, rows, lm_head, labels, valid, prev, teacher, 3.0)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    params = [rows, *drafter.markov_head.parameters(), *drafter.confidence_head.parameters()]
    assert len(params) == 7  # rows, W1, W2, the gate's or joint projection's weight and bias, confidence's two
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_the_walk_steps_the_state_as_the_loop_does(kind):
    drafter = markov_drafter(kind, seed=5)
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(4, H, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.05
    w2 = drafter.markov_head.markov_w2.weight
    logits_fn = lambda r, bias=None: r @ lm_head.T + (0 if bias is None else bias)  # noqa: E731
    for anchor in (0, 40):
        tokens, q = drafter.propose(rows, anchor, logits_fn, 0.0)
        prev = torch.tensor([anchor] + tokens[:-1].tolist())
        latents = naive_latents(drafter, rows, prev)  # the chain each drafted token conditioned on
        chain = [int((rows[k] @ lm_head.T + w2 @ latents[k]).argmax()) for k in range(4)]
        assert q is None and tokens.tolist() == chain
        assert torch.equal(drafter.greedy(rows[None], prev[None], logits_fn)[0], tokens)  # teacher forced alike


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_export_carries_the_form_and_says_vllm_serves_only_vanilla(tmp_path, kind):
    drafter = markov_drafter(kind).float()
    out = save_zlab(drafter, tmp_path / kind, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["markov_head_type"] == kind and "markov_head_type" not in config["dflash_config"]
    names = {"gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
             "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}}[kind]
    assert names <= set(drafter.state_dict())
    text = serve_instructions(out)
    assert "--speculative-algorithm DSPARK" in text and "vLLM:   not served: vLLM 0.34 builds only the vanilla" in text
    assert any(note.startswith("vLLM does not serve this dspark drafter") for note in engine_notes(out))
    vanilla = dataclasses.replace(drafter.config, markov_head_type="vanilla")
    assert build_drafter(vanilla).state_dict().keys() < drafter.state_dict().keys()
