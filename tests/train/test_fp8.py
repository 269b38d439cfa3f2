"""FP8: the drafter's linear layers swapped for torchao's Float8Linear (train.precision=fp8) keep the
parameters, checkpoint keys and z-lab export; their matmuls match a float8 quantize-dequantize
reference; the optimizer still owns the weights; the errors name the option. torch 2.13 runs float8
matmuls (torch._scaled_mm) on the CPU, so the numerics run here; the target's float8 inference
(torchao quantize_) refuses the CPU, so its test runs on an FP8 GPU only."""

import pytest
import torch
from torch import nn

from dflash_train.config import ConfigError, RunConfig
from dflash_train.overrides import apply_overrides
from dflash_train.fp8 import fp8_problem
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.export.hf_format import load_zlab, save_zlab
from dflash_train.model.target.target import tap_relative_errors
from dflash_train.train.state.checkpoint import DrafterState
from dflash_train.train.optim.optimizer import MasterWeightAdamW, param_dtype
from dflash_train.train.parallel.parallelize import apply_precision, convert_to_fp8, parallelize
from dflash_train.train.setup import init_drafter
from dflash_train.validate import precision_problems

torchao = pytest.importorskip("torchao", reason="the fp8 extra (torchao) is not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
NO_FP8_GPU = fp8_problem(None)


def _drafter(intermediate: int = 128, seed: int = 0) -> DFlashDrafter:
    from transformers import Qwen3Config

    tcfg = Qwen3Config(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256)
    dcfg = drafter_config_from_target(tcfg, num_layers=2, block_size=4, mask_token_id=255, num_taps=3)
    drafter = DFlashDrafter(dcfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(seed))
    return drafter


LINEARS = ["fc"] + [f"layers.{i}.{part}" for i in range(2) for part in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_swaps_every_linear_and_keeps_parameters_and_keys(recipe):
    drafter = _drafter()
    params = {name: p for name, p in drafter.named_parameters()}
    before = {k: (v.shape, v.dtype) for k, v in drafter.state_dict().items()}
    converted, skipped = convert_to_fp8(drafter, recipe, "all")
    assert sorted(converted) == sorted(LINEARS) and skipped == []
    assert all(isinstance(drafter.get_submodule(n), Float8Linear) for n in LINEARS)
    assert {k: (v.shape, v.dtype) for k, v in drafter.state_dict().items()} == before
    after = dict(drafter.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is params[n] for n in params)  # the very same objects
    assert all(type(p) is nn.Parameter for p in after.values())  # plain parameters: the optimizer can own them


def test_layers_whose_dims_are_not_multiples_of_16_stay_and_are_reported():
    drafter = _drafter(intermediate=72)  # gate/up (64 -> 72) and down (72 -> 64) cannot run in float8
    converted, skipped = convert_to_fp8(drafter, "tensorwise", "all")
    mlp = {f"layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(skipped) == mlp and set(converted) == set(LINEARS) - mlp
    assert all(type(drafter.get_submodule(n)) is nn.Linear for n in mlp)


def test_auto_filter_converts_what_it_reports_and_keeps_small_layers_as_they_are():
    """train.fp8_filter=auto (the default): the layers torchao's size rule sends to float8 are the ones
    converted and reported; a GQA k/v-shaped layer (K 4096, N 1024) stays an nn.Linear."""
    root = nn.ModuleDict({"q": nn.Linear(4096, 4096, bias=False, device="meta"),
                          "k": nn.Linear(4096, 1024, bias=False, device="meta")})
    converted, skipped = convert_to_fp8(root, "tensorwise")
    assert (converted, skipped) == (["q"], ["k"])
    assert isinstance(root["q"], Float8Linear) and type(root["k"]) is nn.Linear


def _float8_reference(x: torch.Tensor, w: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """x @ w.T with both operands scaled to the e4m3 range (per tensor, or per row of x and of w),
    rounded to e4m3, multiplied exactly in float32 and unscaled: what a float8 linear computes.
    torchao's rowwise recipe rounds each scale down to a power of two (exact to unscale)."""
    def quantize(t):
        amax = t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().amax()
        scale = E4M3_MAX / amax.double().clamp(min=1e-12).float()
        if rowwise:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale
    return quantize(x) @ quantize(w).T


def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes per-row scales (2.13 does; 2.11 asserts
    "only supports per-tensor scaling for CPU backend")."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.T, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _numerics_device(recipe: str) -> torch.device:
    """An FP8 GPU where there is one (what training uses), else the CPU where its float8 matmul
    supports the recipe."""
    if NO_FP8_GPU is None:
        return torch.device("cuda")
    if recipe == "rowwise" and not _cpu_rowwise_scaled_mm():
        pytest.skip(f"torch {torch.__version__}: the CPU float8 matmul has no per-row scales and there is no FP8 GPU")
    return torch.device("cpu")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_matches_the_quantize_dequantize_reference(recipe):
    device = _numerics_device(recipe)
    torch.manual_seed(0)
    linear = nn.Linear(192, 64, bias=False).to(device, torch.bfloat16)  # fc's shape with 3 taps of 64
    x = torch.randn(48, 192, dtype=torch.bfloat16, device=device)
    exact = x.float() @ linear.weight.detach().float().T
    reference = _float8_reference(x, linear.weight.detach(), rowwise=recipe == "rowwise")
    model = nn.Sequential(linear)
    convert_to_fp8(model, recipe, "all")
    x.requires_grad_(True)
    out = model(x)
    float8_error = float((reference - exact).norm() / exact.norm())
    assert float((out.float() - reference).norm() / reference.norm()) < 0.005  # the bf16 output's rounding
    assert 0.01 < float8_error < 0.1  # float8 rounding is visible: the reference is not the bf16 matmul
    grad = torch.randn_like(out)  # on the device of `out`
    out.backward(grad)
    ref_grad_x = grad.float() @ linear.weight.float()
    ref_grad_w = grad.float().T @ x.detach().float()
    for got, ref in ((x.grad, ref_grad_x), (linear.weight.grad, ref_grad_w)):
        assert float((got.float() - ref).norm() / ref.norm()) < 0.1  # e5m2 gradients, e4m3 operands


def test_master_weight_optimizer_owns_the_float8_weights():
    drafter = _drafter()
    reference = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    opt = MasterWeightAdamW(drafter.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    apply_precision(drafter, param_dtype(opt))  # what parallelize does first
    convert_to_fp8(drafter, "tensorwise", "all")
    taps = torch.randn(2, 32, 3 * 64, dtype=torch.bfloat16)
    ctx = drafter.fuse_context(taps)  # [2, 32, 64] through the float8 fc
    loss = sum(layer.mlp(layer.self_attn.o_proj(layer.self_attn.q_proj(ctx))).float().pow(2).mean()
               for layer in drafter.layers)
    loss.backward()
    assert all(drafter.get_submodule(n).weight.grad is not None for n in LINEARS if "k_proj" not in n
               and "v_proj" not in n)
    opt.step()
    for name, p in drafter.named_parameters():
        master = opt.state[p]["master"]
        torch.testing.assert_close(p.detach(), master.to(torch.bfloat16), rtol=0, atol=0)  # the update wrote it
        if p.grad is not None:
            assert not torch.equal(master, reference[name])


def test_muon_and_float32_sums_own_the_float8_weights():
    """optim.name=muon on a float8 drafter (bf16 parameters, float32 masters): Muon's matrices are the
    Float8Linear weights themselves, two micro-batches are summed in float32 (train/optim/grads.py), and
    the step writes every master, rounded, into the module's weights."""
    from dflash_train.config import OptimConfig
    from dflash_train.train.optim.grads import float32_grads
    from dflash_train.train.optim.optimizer import build_optimizer
    from dflash_train.train.step import clip_and_step

    drafter = _drafter()
    reference = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    opt, _ = build_optimizer(drafter.named_parameters(), OptimConfig(name="muon", lr=1e-2), 10, master_weights=True)
    apply_precision(drafter, param_dtype(opt))
    convert_to_fp8(drafter, "tensorwise", "all")
    assert {id(p) for p in opt.params} == {id(drafter.get_submodule(n).weight) for n in LINEARS}
    sums = float32_grads(opt, micro_batches=2)
    for i in range(2):
        taps = torch.randn(2, 32, 3 * 64, generator=torch.Generator().manual_seed(i)).bfloat16()
        ctx = drafter.fuse_context(taps)  # [2, 32, 64] through the float8 fc
        sum(layer.mlp(layer.self_attn.o_proj(layer.self_attn.q_proj(ctx))).float().pow(2).mean()
            for layer in drafter.layers).backward()
        sums.add(first=i == 0)
    params = sums.stepped()
    clip_and_step(opt, params, 1.0, grads=[sums.grad(p) for p in params])
    muon_masters = {id(p): m for p, m in zip(opt.params, opt.masters)}
    moved = 0
    for name, p in drafter.named_parameters():
        master = muon_masters[id(p)] if id(p) in muon_masters else opt.adamw.state[p]["master"]
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), master.bfloat16()), name
        if sums.has(p):
            assert not torch.equal(master, reference[name]), name
            moved += 1
    assert moved == len(LINEARS) - 4 + 1  # k_proj and v_proj of both layers have no gradient here; hidden_norm has


def test_checkpoint_and_zlab_export_are_those_of_the_unconverted_drafter(tmp_path):
    plain, fp8 = _drafter(seed=3), _drafter(seed=3)
    opt = MasterWeightAdamW(fp8.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    apply_precision(fp8, param_dtype(opt))
    convert_to_fp8(fp8, "rowwise", "all")
    DrafterState(fp8, opt).save(tmp_path / "ckpt")  # float32 masters, as the checkpointer writes them
    save_zlab(plain, tmp_path / "plain", dtype=torch.float32)
    loaded, expected = load_zlab(tmp_path / "ckpt").state_dict(), load_zlab(tmp_path / "plain").state_dict()
    assert loaded.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(loaded[key], expected[key], rtol=0, atol=0)
    assert (tmp_path / "ckpt" / "config.json").read_text() == (tmp_path / "plain" / "config.json").read_text()
    save_zlab(fp8, tmp_path / "export")  # bf16 export straight from the converted module
    exported = load_zlab(tmp_path / "export").state_dict()
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in expected.items()}
    fresh = _drafter(seed=4)  # resume: the saved weights load back into a converted drafter's masters
    opt2 = MasterWeightAdamW(fresh.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    apply_precision(fresh, param_dtype(opt2))
    convert_to_fp8(fresh, "rowwise", "all")
    DrafterState(fresh, opt2).load(tmp_path / "ckpt")
    for p, q in zip(fresh.parameters(), plain.parameters()):
        torch.testing.assert_close(opt2.state[p]["master"], q.detach(), rtol=0, atol=0)


def test_cpu_runs_are_refused_naming_the_option():
    cfg = apply_overrides(RunConfig(), ["train.precision=fp8", "target.precision=fp8", "train.fp8_recipe=rowwise"])
    assert (cfg.train.precision, cfg.target.precision, cfg.train.fp8_recipe) == ("fp8", "fp8", "rowwise")
    with pytest.raises(ConfigError, match="expected one of auto, bf16, fp8"):
        apply_overrides(RunConfig(), ["train.precision=fp16"])
    assert precision_problems(RunConfig()) == []
    if NO_FP8_GPU is None:
        pytest.skip("this machine has an FP8 GPU: nothing to refuse")
    problems = precision_problems(cfg)
    assert len(problems) == 2
    assert "train.precision=fp8" in problems[0] and "set train.precision=bf16" in problems[0]
    assert "set target.precision=bf16" in problems[1]
    with pytest.raises(RuntimeError, match="set train.precision=bf16 to run without FP8"):
        parallelize(_drafter(), device=torch.device("cpu"), compile_model=False, dp_group=None, num_drafters=1,
                    precision="fp8")
    with pytest.raises(ValueError, match="train.precision='fp9'"):
        parallelize(_drafter(), device=torch.device("cpu"), compile_model=False, dp_group=None, num_drafters=1,
                    precision="fp9")


def test_tap_relative_errors_per_layer_against_brute_force():
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(2, 5, 3 * 8, generator=g)
    taps = reference.clone()
    taps[..., 8:16] += 0.1 * torch.randn(2, 5, 8, generator=g)  # only the second tap differs
    errors = tap_relative_errors(reference, taps.bfloat16(), 3)
    by_hand = [float(((taps[..., i * 8:(i + 1) * 8].bfloat16().float() - reference[..., i * 8:(i + 1) * 8]) ** 2)
                     .sum().sqrt() / (reference[..., i * 8:(i + 1) * 8] ** 2).sum().sqrt()) for i in range(3)]
    assert errors == pytest.approx(by_hand, rel=1e-5)
    assert errors[0] < 1e-2 and errors[1] > 5e-2


def test_init_drafter_on_the_meta_device_sets_every_parameter(tiny_qwen3_target):
    from dflash_train.train.setup import build_drafter_config

    cfg = apply_overrides(RunConfig(), ["drafter.num_layers=2", "drafter.num_taps=3"])
    dcfg = build_drafter_config(cfg, tiny_qwen3_target)
    for from_target in (False, True):
        built = init_drafter(dcfg, tiny_qwen3_target, 7, from_target, torch.device("cpu"), norm_scale=0.5)
        reference = DFlashDrafter(dcfg)  # the CPU build it replaces
        reference.reset_parameters(generator=torch.Generator().manual_seed(7))
        if from_target:
            from dflash_train.train.setup import _copy_from_target

            _copy_from_target(reference, tiny_qwen3_target)
        with torch.no_grad():
            reference.norm.weight.mul_(0.5)
        assert built.state_dict().keys() == reference.state_dict().keys()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(built.state_dict()[key], value.float(), rtol=0, atol=0, msg=key)


@pytest.mark.skipif(NO_FP8_GPU is not None, reason=f"needs an FP8 GPU: {NO_FP8_GPU}")
def test_fp8_target_taps_stay_close_to_bf16_taps():
    from tests.conftest import tiny_qwen3

    from dflash_train.model.target.target import Target

    model = tiny_qwen3(512, hidden=128).to("cuda", torch.bfloat16)
    target = Target(model=model, tokenizer=None, name="tiny")
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    reference = target.taps(ids, None, [1, 3, 5])
    converted = target.quantize_fp8(log=lambda line: None)
    assert len(converted) == 6 * 7
    errors = tap_relative_errors(reference, target.taps(ids, None, [1, 3, 5]), 3)
    assert all(1e-4 < e < 0.1 for e in errors), errors


@pytest.mark.skipif(NO_FP8_GPU is not None, reason=f"needs an FP8 GPU: {NO_FP8_GPU}")
def test_fp8_drafter_compiles_and_trains_on_the_gpu():
    drafter = _drafter().cuda()
    opt = MasterWeightAdamW(drafter.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, compiled=True)
    lines = []
    parallelize(drafter, device=torch.device("cuda"), compile_model=False, dp_group=None, num_drafters=1,
                param_dtype=param_dtype(opt), precision="fp8", fp8_filter="all", log=lines.append)
    assert lines == [f"fp8: drafter: {len(LINEARS)} of {len(LINEARS)} linear layers in float8 (tensorwise, filter all)"]
    taps = torch.randn(2, 64, 3 * 64, device="cuda", dtype=torch.bfloat16)
    before = drafter.fc.weight.detach().clone()
    torch.compile(drafter.fuse_context)(taps).float().pow(2).mean().backward()
    opt.step()
    assert isinstance(drafter.fc, Float8Linear) and not torch.equal(before, drafter.fc.weight)


# ---------------------------------------------------------------------------------------------
# train.fp8_lm_head: the loss's frozen lm_head in float8


def _head_problem(device, mix, compiled=False):
    """Per-row losses and d loss / d hidden of one chunked loss, bf16 lm_head vs float8 lm_head, with
    the float32 reference of the same bf16 inputs."""
    from dflash_train.fp8 import float8_head
    from dflash_train.train.loss.objective import linear_softmax_loss
    from dflash_train.train.loss.softmax_rows import RowsSpec

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(96, 64, generator=g) * 2).to(device, torch.bfloat16)
    weight = (torch.randn(256, 64, generator=g) * 0.2).to(device, torch.bfloat16)
    teacher = (torch.randn(96, 64, generator=g) * 2).to(device, torch.bfloat16)
    labels = torch.randint(0, 256, (96,), generator=g).to(device)
    out = {}
    for name, fp8, w in (("exact", None, weight.float()), ("bf16", None, weight), ("fp8", float8_head(weight), weight)):
        h = (hidden.float() if name == "exact" else hidden).clone().requires_grad_(True)
        rows = linear_softmax_loss(h, w, labels, teacher.to(w.dtype), chunk=40, spec=RowsSpec(mix), fp8=fp8,
                                   compiled=compiled and name != "exact")
        loss = rows.losses
        rows.loss_sum.float().backward()
        out[name] = (loss.detach().float(), h.grad.float())
    return out


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", ["ce", "mix"])
def test_float8_lm_head_loss_and_gradient_track_the_exact_ones(kind):
    """Three chunks (40, 40, 16 rows): losses and hidden gradients within float8 rounding of the float32
    reference, and visibly not the bf16 matmul (so the float8 path ran)."""
    from dflash_train.train.loss.objective import LossMix

    mix = LossMix.from_config(apply_overrides(RunConfig(), [f"loss.kind={kind}"]).loss)
    out = _head_problem(_numerics_device("tensorwise"), mix)
    (exact_loss, exact_grad), (bf16_loss, bf16_grad), (fp8_loss, fp8_grad) = out["exact"], out["bf16"], out["fp8"]
    assert _rel(bf16_loss, exact_loss) < 0.01 and _rel(bf16_grad, exact_grad) < 0.02
    assert 0.002 < _rel(fp8_loss, exact_loss) < 0.05, _rel(fp8_loss, exact_loss)
    assert _rel(fp8_grad, exact_grad) < 0.15 and _rel(fp8_grad, bf16_grad) > 2 * _rel(bf16_grad, exact_grad)


def test_float8_lm_head_refuses_unaligned_shapes():
    from dflash_train.fp8 import float8_head

    with pytest.raises(ValueError, match=r"train.fp8_lm_head: the lm_head \(250, 64\) is not a multiple of 16"):
        float8_head(torch.zeros(250, 64, dtype=torch.bfloat16))


@pytest.mark.skipif(NO_FP8_GPU is not None, reason=f"needs an FP8 GPU: {NO_FP8_GPU}")
def test_float8_lm_head_compiled_equals_eager_on_the_gpu():
    from dflash_train.train.loss.objective import CE

    eager, compiled = _head_problem("cuda", CE), _head_problem("cuda", CE, compiled=True)
    assert _rel(compiled["fp8"][0], eager["fp8"][0]) < 0.01 and _rel(compiled["fp8"][1], eager["fp8"][1]) < 0.02
