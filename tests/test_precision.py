"""The drafter's precision policy (dflash_train/fp8.py, validate.precision_problems): which precision
`train.precision=auto` picks and why, and the settings refused before anything loads. None of it
needs torchao, so it runs everywhere (tests/train/test_fp8.py, the float8 numerics, needs the extra)."""

import pytest

from dflash_train.config import ConfigError, RunConfig
from dflash_train.overrides import apply_overrides
from dflash_train.validate import precision_problems


def test_precision_auto_picks_fp8_only_where_measured_faster():
    """train.precision=auto: bf16 off CUDA, on a GPU without float8 and for narrow drafters (SmolLM2's
    576: float8 measured slower); fp8 from FP8_AUTO_MIN_WIDTH up on a float8 GPU; explicit settings win."""
    from dflash_train.fp8 import FP8_AUTO_MIN_WIDTH, auto_precision, resolve_precision

    assert RunConfig().train.precision == "auto" and RunConfig().train.fp8_lm_head is None
    assert resolve_precision("auto", "cpu", 4096) == ("bf16", "auto: no float8 off CUDA")
    assert resolve_precision("bf16", "cpu", 4096)[0] == "bf16" and resolve_precision("fp8", "cpu", 576)[0] == "fp8"
    assert resolve_precision("auto", "cuda", 4096, compiled=False)[0] == "bf16"  # casts unfused: no gain measured
    assert auto_precision(None, FP8_AUTO_MIN_WIDTH) == ("fp8", f"auto: drafter width {FP8_AUTO_MIN_WIDTH} >= "
                                                               f"{FP8_AUTO_MIN_WIDTH} on a float8 GPU")
    assert auto_precision(None, 576)[0] == "bf16" and "width 576 <" in auto_precision(None, 576)[1]
    assert auto_precision("torchao is not installed", 8192) == ("bf16", "auto: torchao is not installed")
    with pytest.raises(ValueError, match="train.precision='fp16': expected auto, bf16 or fp8"):
        resolve_precision("fp16", "cpu", 4096)
    with pytest.raises(ConfigError, match="expected one of auto, bf16, fp8"):
        apply_overrides(RunConfig(), ["train.precision=fp16"])


def test_float8_lm_head_needs_a_drafter_that_may_train_in_fp8():
    problems = precision_problems(apply_overrides(RunConfig(), ["train.precision=bf16", "train.fp8_lm_head=true"]))
    assert problems == ["train.fp8_lm_head=true: the lm_head runs in float8 only when the drafter does "
                        "(train.precision=fp8, or auto where it picks fp8)"]
    assert precision_problems(apply_overrides(RunConfig(), ["train.fp8_lm_head=true"])) == []  # auto may pick fp8
    assert precision_problems(RunConfig()) == []  # the default (auto) is never refused


def test_fp8_alignment_rule():
    from dflash_train.fp8 import fp8_aligned

    assert fp8_aligned(49152, 576) and fp8_aligned(4096)
    assert not fp8_aligned(250, 64) and not fp8_aligned(4096, 4104)


def test_fp8_filter_all_takes_every_aligned_linear_and_names_what_stays_bf16():
    from torch import nn

    from dflash_train.fp8 import describe_conversion, fp8_fits, fp8_module_filter, split_linears

    root = nn.ModuleDict({"q": nn.Linear(32, 32), "k": nn.Linear(32, 16), "v": nn.Linear(32, 16), "odd": nn.Linear(30, 16)})
    assert fp8_module_filter("tensorwise", "all") is fp8_fits
    assert split_linears(root, fp8_fits) == (["q", "k", "v"], ["odd"])
    wide_only = lambda m, n: fp8_fits(m) and m.out_features > 16  # noqa: E731 - a size rule in miniature
    converted, skipped = split_linears(root, wide_only)
    assert (converted, skipped) == (["q"], ["k", "v", "odd"])
    assert describe_conversion("drafter", "tensorwise", converted, skipped, root) == (
        "fp8: drafter: 1 of 4 linear layers in float8 (tensorwise); kept in bf16 (size rule): 2 x (16, 32); "
        "kept in bf16 (dims not multiples of 16): 1 x (16, 30)")
    with pytest.raises(ValueError, match="train.fp8_filter='some': expected one of auto, all"):
        fp8_module_filter("tensorwise", "some")
    with pytest.raises(ConfigError, match="expected one of auto, all"):
        apply_overrides(RunConfig(), ["train.fp8_filter=some"])
    assert RunConfig().train.fp8_filter == "auto"


def test_fp8_filter_auto_is_torchaos_size_rule():
    """auto keeps in bf16 what torchao's H100 tables say float8 slows down: at the paper shapes the GQA
    k/v projections (K 4096, N 1024); q/o, the MLP and fc convert."""
    pytest.importorskip("torchao.float8")
    from torch import nn

    from dflash_train.fp8 import fp8_module_filter

    keep = fp8_module_filter("tensorwise", "auto")
    shapes = {"q": (4096, 4096), "k": (4096, 1024), "gate": (4096, 12288), "down": (12288, 4096), "fc": (20480, 4096),
              "odd": (4096, 1000)}
    kept = {name for name, (k, n) in shapes.items() if keep(nn.Linear(k, n, device="meta"), name)}
    assert kept == {"q", "gate", "down", "fc"}
