"""The drafter's precision policy (dflash_train/fp8.py, validate.precision_problems): which precision
`train.precision=auto` picks and why, and the settings refused before anything loads. None of it
needs torchao, so it runs everywhere (tests/train/test_fp8.py, the float8 numerics, needs the extra)."""

import pytest

from dflash_train.config import ConfigError, RunConfig, apply_overrides
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
