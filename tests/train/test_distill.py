"""Distillation: the target's final hidden state as a teacher (where it comes from, how the block
slots read it, what the teacher losses compute), and its routes through the whole job: colocated,
disaggregated (gloo) and offline shards (bf16, fp8) give the colocated run's losses."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_train.config import LossConfig, RunConfig
from dflash_train.data.records import Conversation
from dflash_train.data.regen_taps import TappedSamples, regenerate_with_taps
from dflash_train.train.feed.batching import MicroBatch
from dflash_train.train.loss.objective import CE, LossMix, teacher_hidden_at
from dflash_train.train.feed.taps import FINAL_HIDDEN, StoredRows, TapsSpec, TensorField, target_tensors
from dflash_train.validate import config_problems
from tests.train.loss.test_loss import dflash_block_loss, make_case, naive_loss
from tests.train.test_pipeline import losses, run, run_here

IDS = [1, 3]


def test_teacher_hidden_of_drafted_token_i_is_the_target_at_a_plus_i():
    """Drafted token i of anchor a is token a + i + 1, which the target predicts at position a + i."""
    g = torch.Generator().manual_seed(0)
    final = torch.randn(2, 12, 4, generator=g)
    anchors = torch.tensor([[0, 5, 9], [2, 3, 11]])
    got = teacher_hidden_at(final, anchors, drafted=3)
    assert got.shape == (2, 3, 3, 4)
    for i in range(2):
        for j in range(3):
            for k in range(3):
                pos = int(anchors[i, j]) + k
                if pos < 12:  # past the end: never a valid slot
                    assert torch.equal(got[i, j, k], final[i, pos])


def test_ce_teacher_is_ce_on_the_teacher_argmax_and_accuracy_stays_on_data_tokens():
    hidden, weight, labels, valid = make_case(seed=3)
    teacher = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    argmax_labels = (teacher @ weight.T).argmax(-1)  # [b, N, B]
    got = dflash_block_loss(hidden, weight, labels, valid, 2.0, chunk_tokens=5, teacher_hidden=teacher,
                     mix=LossMix(ce=0.0, ce_teacher=1.0))
    ref = dflash_block_loss(hidden, weight, argmax_labels, valid, 2.0, chunk_tokens=5)
    torch.testing.assert_close(got.loss_sum, ref.loss_sum, rtol=1e-12, atol=1e-12)
    (g1,), (g2,) = torch.autograd.grad(got.loss_sum, hidden), torch.autograd.grad(ref.loss_sum, hidden)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)
    on_data = dflash_block_loss(hidden, weight, labels, valid, 2.0)  # the same drafter argmax, data labels
    assert torch.equal(got.slot_correct, on_data.slot_correct)
    assert not torch.equal(ref.slot_correct, on_data.slot_correct)  # the two label sets differ: not vacuous


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_kl_vanishes_where_the_drafter_is_the_target(temperature):
    hidden, weight, labels, valid = make_case(seed=5)
    teacher = hidden.detach().view(2, 3, 5, 8)
    stats = dflash_block_loss(hidden, weight, labels, valid, 2.0, teacher_hidden=teacher,
                       mix=LossMix(ce=0.0, kl=1.0, temperature=temperature))
    (grad,) = torch.autograd.grad(stats.loss_sum, hidden)
    assert abs(float(stats.loss_sum.detach())) < 1e-12 and float(grad.abs().max()) < 1e-12
    moved = dflash_block_loss(hidden * 1.5, weight, labels, valid, 2.0, teacher_hidden=teacher,
                       mix=LossMix(ce=0.0, kl=1.0, temperature=temperature))
    assert float(moved.loss_sum) > 1e-3


def test_temperature_follows_the_t_squared_convention():
    """T^2 * KL(softmax(t/T) || softmax(s/T)) tends, for large T, to sum_v (d_v - mean d)^2 / (2V)
    with d = s - t (Hinton et al.'s logit matching); an unscaled KL would vanish like 1/T^2."""
    hidden, weight, labels, valid = make_case(seed=6)
    teacher = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    big_t = 1000.0
    stats = dflash_block_loss(hidden, weight, labels, valid, 2.0, teacher_hidden=teacher,
                       mix=LossMix(ce=0.0, kl=1.0, temperature=big_t))
    s = (hidden.detach().view(2, 3, 5, 8) @ weight.T)[:, :, 1:]
    t = (teacher @ weight.T)[:, :, 1:]  # [b, N, B-1, V]: the drafted slots
    d = (s - t) - (s - t).mean(-1, keepdim=True)
    limit = (d ** 2).mean(-1) / 2  # [b, N, B-1]
    w = torch.exp(-(torch.arange(1, 5, dtype=torch.float64) - 1) / 2.0) * valid[:, :, 1:]
    torch.testing.assert_close(stats.loss_sum, (w * limit).sum(), rtol=1e-2, atol=0)


def test_train_vocab_kl_renormalises_the_teacher_over_the_subset():
    """With loss.train_vocab the teacher's softmax runs over the subset's rows (an approximation
    where it puts mass elsewhere): block_loss over the subset rows == the naive KL over them."""
    hidden, weight, labels, valid = make_case(seed=8, vocab=11)
    teacher = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    subset = torch.tensor([0, 2, 3, 7, 10])
    mix = LossMix(ce=0.0, kl=1.0, temperature=1.5)
    got = dflash_block_loss(hidden, weight[subset], labels.clamp(max=4), valid, 2.0, teacher_hidden=teacher, mix=mix)
    want = naive_loss(hidden, weight[subset], labels.clamp(max=4), valid, 2.0, teacher, mix)
    torch.testing.assert_close(got.loss_sum / got.weight_sum, want, rtol=1e-12, atol=1e-12)
    full = dflash_block_loss(hidden, weight, labels, valid, 2.0, teacher_hidden=teacher, mix=mix)
    assert not torch.allclose(full.loss_sum, got.loss_sum)  # the subset changes the objective


def test_loss_kind_maps_to_a_mix_and_is_validated():
    assert LossMix.from_config(LossConfig()) == CE and not LossConfig().needs_target_hidden
    assert LossMix.from_config(LossConfig(kind="mix", kl_weight=0.25, temperature=2.0)) == \
        LossMix(ce=0.75, kl=0.25, temperature=2.0)
    assert LossMix.from_config(LossConfig(kind="ce_teacher")) == LossMix(ce=0.0, ce_teacher=1.0)
    assert LossConfig(kind="kl").needs_target_hidden
    assert not config_problems(RunConfig(loss=LossConfig(kind="kl")))
    problems = config_problems(RunConfig(loss=LossConfig(kind="mix", kl_weight=1.5, temperature=0.0)))
    assert any("loss.kl_weight" in p for p in problems) and any("loss.temperature" in p for p in problems)


def test_final_hidden_is_hf_last_hidden_state_after_the_final_norm(tiny_qwen3_target):
    """HF's `hidden_states[-1]` is already after the final norm (Llama, Qwen3); the bundle's
    "final_hidden" equals it, and equals final_norm(last layer output)."""
    target = tiny_qwen3_target
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mb = MicroBatch(["a", "b"], ids, mask, mask, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=bool))
    width = len(IDS) * target.hidden_size
    spec = TapsSpec((TensorField("taps", width, target.dtype), TensorField(FINAL_HIDDEN, target.hidden_size,
                                                                          target.dtype)))
    got = target_tensors(target, IDS, mb, torch.device("cpu"), spec)
    assert list(got) == ["taps", FINAL_HIDDEN]
    hf = target.model(ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(got[FINAL_HIDDEN], hf.hidden_states[-1], rtol=1e-5, atol=1e-5)
    last_layer_out = {}
    handle = target.layers[-1].register_forward_hook(lambda m, a, o: last_layer_out.setdefault("h", o))
    target.taps(ids, mask, IDS, return_last_hidden=True)
    handle.remove()
    h = last_layer_out["h"][0] if isinstance(last_layer_out["h"], tuple) else last_layer_out["h"]
    torch.testing.assert_close(got[FINAL_HIDDEN], target.final_norm(h), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(h, target.final_norm(h))  # the norm does something: not vacuous
    taps_only = target_tensors(target, IDS, mb, torch.device("cpu"), TapsSpec(spec.fields[:1]))
    assert list(taps_only) == ["taps"] and torch.equal(taps_only["taps"], got["taps"])


def test_regenerate_and_tap_keeps_the_final_hidden_state(tiny_qwen3_target, tmp_path):
    target = tiny_qwen3_target
    convs = [Conversation("a", [{"role": "user", "content": "Tell me about rivers."}]),
             Conversation("b", [{"role": "user", "content": "hi"}])]
    tapped, _ = regenerate_with_taps(target, convs, IDS, max_new_tokens=10, batch_size=2, max_len=256,
                                     storage_dtype=torch.float32, final_hidden=True)
    for sample, final in zip(tapped.samples, tapped.final_hidden):
        n = len(sample) - 1  # the last response token is never fed back
        _, full = target.taps(torch.tensor([sample.input_ids]), None, IDS, return_last_hidden=True)
        torch.testing.assert_close(final[:n], full[0, :n], rtol=1e-4, atol=1e-4)
    tapped.save(tmp_path / "t.safetensors")
    again = TappedSamples.load(tmp_path / "t.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(again.final_hidden, tapped.final_hidden))
    rows = StoredRows.in_memory(again.rows(), ("taps", FINAL_HIDDEN))
    assert set(rows[0]) == {"taps", FINAL_HIDDEN}
    TappedSamples(again.samples, again.taps).save(tmp_path / "ce.safetensors")
    ce_only = TappedSamples.load(tmp_path / "ce.safetensors")
    assert ce_only.final_hidden is None
    with pytest.raises(KeyError, match="final hidden state"):
        StoredRows.in_memory(ce_only.rows(), ("taps", FINAL_HIDDEN))[0]


# ---------------------------------------------------------------------------------------------
# The whole job (slow: real processes, gloo)

KL = ("loss.kind=kl", "loss.temperature=2.0")


def _prepare(target_dir, out, fmt, *extra):
    """`dflash-train prepare` through cli.main in this process (the one-process jobs below run there too:
    no interpreter start of their own; the tests take the `contained` fixture)."""
    from dflash_train.cli import main

    assert main(["prepare", "--target", str(target_dir), "--data", "chitchat", "--out", str(out), "--max-samples", "80",
                 "--max-len", "256", "--format", fmt, "--num-taps", "3", *extra]) == 0


@pytest.fixture(scope="module")
def colocated_kl(tiny_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated_kl")
    proc = run(1, tiny_target_dir, out, *KL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = losses(out)
    assert len(set(got.values())) > 1  # the loss moves: comparisons are not vacuous
    return got


def _close(got, want, rel):
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert math.isclose(got[step], loss, rel_tol=rel), (step, got[step], loss)


@pytest.mark.slow
def test_disaggregated_kl_equals_colocated(colocated_kl, tiny_target_dir, tmp_path):
    """1 target rank sends taps and final hidden states over gloo to 1 drafter rank."""
    proc = run(2, tiny_target_dir, tmp_path, *KL, "topology.mode=disaggregated", "topology.target_ranks=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _close(losses(tmp_path), colocated_kl, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,rel", [("bf16", 2e-3), ("fp8", 2e-2)])
def test_offline_kl_equals_colocated_within_storage_precision(colocated_kl, tiny_target_dir, tmp_path, contained, fmt,
                                                              rel):
    """Shards prepared for the KL loss (taps + final hidden in bf16 or fp8): the colocated losses
    within the storage rounding (bf16: 8 mantissa bits; fp8 e4m3: 4, one scale per row)."""
    shards = tmp_path / "shards"
    _prepare(tiny_target_dir, shards, fmt, "loss.kind=kl")
    assert run_here(tiny_target_dir, tmp_path / "run", *KL, "topology.mode=offline", f"data.shards={shards}") == 0
    _close(losses(tmp_path / "run"), colocated_kl, rel=rel)


@pytest.mark.slow
def test_offline_kl_on_ce_shards_names_the_fix(tiny_target_dir, tmp_path, contained, capsys):
    shards = tmp_path / "shards"
    _prepare(tiny_target_dir, shards, "bf16")
    capsys.readouterr()
    assert run_here(tiny_target_dir, tmp_path / "run", *KL, "topology.mode=offline", f"data.shards={shards}") != 0
    out = "".join(capsys.readouterr())
    assert "final hidden state" in out and "prepare" in out
