"""Gradients summed in float32 (train/optim/grads.py) and normalised after the forwards (train/step.py):
a bf16 model's summed gradients equal the float32 sum of its micro-batches' gradients; k
micro-batches step as one batch of k; D gloo ranks step as one process, for every optimizer path
(float32 + DDP, bf16 + float32 masters without DDP, Muon)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dflash_train.config import OptimConfig
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.target.target import Target
from dflash_train.train.feed.batching import MicroBatch
from dflash_train.train.optim.grads import Float32Grads
from dflash_train.train.optim.optimizer import build_optimizer, full_precision_weights, param_dtype
from dflash_train.train.parallel.parallelize import parallelize
from dflash_train.train.step import StepContext, train_step
from tests.conftest import tiny_qwen3

# (optim.name, float32 masters over bf16 parameters): every path the step has on a CPU
PATHS = [("adamw", False), ("adamw", True), ("muon", False), ("muon", True)]
STEPS = 3


# --- the float32 sums themselves -------------------------------------------------------------------

def _bf16_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 4)).bfloat16()
    model.register_parameter("unused", nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)))  # never in a forward
    return model


def _backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().pow(2).sum().backward()


def test_float32_sums_of_bf16_gradients_equal_float32_accumulation():
    """Six micro-batches of very different scales: the sums are exactly the float32 sums of each
    micro-batch's own bf16 gradient, where autograd's bf16 accumulation loses bits."""
    model = _bf16_model()
    gen = torch.Generator().manual_seed(1)
    xs = [(torch.randn(8, 16, generator=gen) * (30.0 if i % 2 else 0.03)).bfloat16() for i in range(6)]
    used = [p for name, p in model.named_parameters() if name != "unused"]
    reference = [torch.zeros(p.shape) for p in used]
    for x in xs:
        model.zero_grad()
        _backward(model, x)
        for r, p in zip(reference, used):
            r += p.grad.float()
    model.zero_grad()
    for x in xs:  # autograd's own accumulation, in the parameters' bf16
        _backward(model, x)
    in_bf16 = [p.grad.float() for p in used]
    model.zero_grad()
    sums = Float32Grads(list(model.parameters()))
    for i, x in enumerate(xs):
        _backward(model, x)
        sums.add(first=i == 0)
        assert all(p.grad is None for p in model.parameters())  # the next backward starts a fresh bf16 .grad
    for r, p in zip(reference, used):
        assert sums.grad(p).dtype == torch.float32 and torch.equal(sums.grad(p), r)
    assert any(not torch.equal(b, r) for b, r in zip(in_bf16, reference))  # bf16 would differ: the test can fail
    assert sums.stepped() == used  # a parameter without a gradient takes no step, as with .grad None
    _backward(model, xs[0])  # the next step starts over
    sums.add(first=True)
    model.zero_grad()
    _backward(model, xs[0])
    assert all(torch.equal(sums.grad(p), p.grad.float()) for p in used)


# --- whole steps of the tiny drafter ------------------------------------------------------------------

def _target() -> Target:
    return Target(model=tiny_qwen3(vocab_size=97, seed=4, init_std=0.2), tokenizer=None, name="tiny")


def micro_batches(step: int, count: int, rows: int = 1) -> list[MicroBatch]:
    """`count` seeded micro-batches of `rows` sequences (24 tokens, 3 anchors each) for `step`."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(count):
        ids = torch.randint(0, 96, (rows, 24), generator=gen)
        loss_mask = (torch.rand(rows, 24, generator=gen) > 0.2).long()  # uneven weight sums per micro-batch
        anchors = torch.stack([torch.sort(torch.randperm(20, generator=gen)[:3]).values for _ in range(rows)])
        out.append(MicroBatch([f"{step}-{i}-{r}" for r in range(rows)], ids, loss_mask, torch.ones_like(ids), anchors,
                              torch.ones(rows, 3, dtype=torch.bool),
                              {"taps": torch.randn(rows, 24, 3 * 64, generator=gen)}))
    return out


def concatenated(mbs: list[MicroBatch]) -> MicroBatch:
    cat = lambda name: torch.cat([getattr(mb, name) for mb in mbs])  # noqa: E731
    return MicroBatch(sum((mb.ids for mb in mbs), []), cat("input_ids"), cat("loss_mask"), cat("attention_mask"),
                      cat("anchors"), cat("keep"), {"taps": torch.cat([mb.taps for mb in mbs])})


def drafter_run(name: str, master: bool, num_drafters: int = 1, dp_group=None):
    """(module the step calls, drafter, optimizer, scheduler, StepContext) as the trainer builds them."""
    target = _target()
    dcfg = drafter_config_from_target(target.config, num_layers=1, block_size=4, mask_token_id=96, num_taps=3)
    drafter = DFlashDrafter(dcfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    cfg = OptimConfig(lr=1e-2, name=name, warmup_ratio=0.3)
    optimizer, scheduler = build_optimizer(drafter.named_parameters(), cfg, 10, master_weights=master)
    model = parallelize(drafter, device=torch.device("cpu"), compile_model=False, dp_group=dp_group,
                        num_drafters=num_drafters, param_dtype=param_dtype(optimizer))
    ctx = StepContext(embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight, drafter=dcfg, gamma=2.0,
                      chunk_tokens=16, backend="sdpa", device=torch.device("cpu"),
                      autocast_dtype=torch.bfloat16 if master else None, dp_group=dp_group, num_drafters=num_drafters)
    return model, drafter, optimizer, scheduler, ctx


def weights(drafter, optimizer) -> dict[str, torch.Tensor]:
    """The float32 weights a checkpoint stores (the masters where there are)."""
    with full_precision_weights(optimizer):
        return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def train(name: str, master: bool, batches, num_drafters: int = 1, dp_group=None) -> tuple[dict, list[float]]:
    model, drafter, optimizer, scheduler, ctx = drafter_run(name, master, num_drafters, dp_group)
    norms = []
    for mbs in batches:
        _, norm, flags = train_step(model, optimizer, scheduler, mbs, ctx, grad_clip=1.0)
        assert flags.sum() == 0
        norms.append(float(norm))
    return weights(drafter, optimizer), norms


def assert_weights_close(got: dict, want: dict, start: dict, share: float) -> None:
    """Every weight within `share` of the largest distance the steps moved any weight (so the
    comparison is not between no-ops, and a Muon step, whose Newton-Schulz runs in bf16, may round
    its few smallest directions differently)."""
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert moved > 1e-3
    for key in want:
        assert float((got[key] - want[key]).abs().max()) <= share * moved, key


@pytest.mark.parametrize("name,master", PATHS)
def test_k_micro_batches_step_as_one_batch_of_k(name, master):
    """3 micro-batches of 1 sequence against 1 micro-batch of 3. The normaliser is the weight sum of
    all of them (their weight sums differ), so a per-micro-batch normalisation changes the
    gradient's direction and norm. AdamW over float32 parameters, 3 steps: the same norms and
    weights to rounding. Muon, 1 step: its Newton-Schulz runs in bf16 and gives every direction of
    a matrix the same step, the noise of a nearly-zero gradient's too, so float32 rounding grows
    into whole steps of some weights after a few steps (measured: up to 40 % of a tensor's move
    after 3). bf16 masters: the bf16 forward of a row depends a little on its batch's shape, and
    Adam's first steps (~lr * sign(g)) turn that into whole steps of the smallest gradients, so only
    the norms are compared: the first step's to 1e-3 (the sum and its normaliser; measured 2026-12-04:
    the bf16 forward alone puts each tensor's summed gradient 0.15-0.35 % from the whole batch's, before
    and after the loss's row weights moved into its chunks, and the norm 2e-4), later ones to 2 %."""
    steps = 1 if name == "muon" else STEPS
    start = weights(*drafter_run(name, master)[1:3])
    split = [micro_batches(step, 3) for step in range(steps)]
    whole = [[concatenated(mbs)] for mbs in split]
    got, got_norms = train(name, master, split)
    want, want_norms = train(name, master, whole)
    if master:
        assert got_norms[0] == pytest.approx(want_norms[0], rel=1e-3)
        assert got_norms == pytest.approx(want_norms, rel=2e-2)
    else:
        assert got_norms == pytest.approx(want_norms, rel=1e-6)
        assert_weights_close(got, want, start, share=1e-3 if name == "adamw" else 5e-3)


# --- D gloo ranks against one process ------------------------------------------------------------------

WORLD = 2


def _rank_runs(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for name, master in PATHS:  # rank r takes micro-batch r of every step
            batches = [micro_batches(step, WORLD)[rank:rank + 1] for step in range(STEPS)]
            results[f"{name}-{master}"] = train(name, master, batches, num_drafters=WORLD, dp_group=None)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # no rank tears gloo down while another still sends (a SIGABRT in a fresh-clone suite)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_drafter_ranks_step_as_one_process(tmp_path):
    """2 gloo ranks of 1 micro-batch each against 1 process with both, 3 steps: for every path the
    same weights bit for bit on both ranks (a sum of 2 numbers has one order; DDP's x2 then /2 is
    exact) and the same gradient norms."""
    mp.spawn(_rank_runs, args=(str(tmp_path / "pg"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    torch.set_num_threads(1)
    for name, master in PATHS:
        want, want_norms = train(name, master, [micro_batches(step, WORLD) for step in range(STEPS)])
        for got, got_norms in (ranks[r][f"{name}-{master}"] for r in range(WORLD)):
            assert got_norms == pytest.approx(want_norms, rel=1e-6), (name, master)
            for key in want:
                assert torch.equal(got[key], want[key]), (name, master, key, float((got[key] - want[key]).abs().max()))
