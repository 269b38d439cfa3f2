"""The losslessness verdict on the real SmolLM2 target: a divergence from plain greedy decoding passes only
as an explained near-tie (the verify pass's top-2 logit gap under the tolerance), anything else fails."""

import json

import pytest
import torch
from eval_helpers import tiny_drafter

from dflash_train.eval import lossless
from dflash_train.eval.evaluate import evaluate
from dflash_train.eval.spec_decode import SpecResult, GenResult

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
TOKEN = 0  # the token the verify forwards are steered to (a low id: argmax takes the first of equal maxima)


def _steer_verify(model, extra: float):
    """A hook on the real lm_head: in forwards of more than one row (the verify pass; the prefill and the
    plain step keep one row), token TOKEN's logit becomes the row's maximum plus `extra`."""
    def hook(module, args, out):
        if out.shape[-2] > 1:
            out = out.clone()
            out[..., TOKEN] = out.max(-1).values + extra
        return out

    return model.get_output_embeddings().register_forward_hook(hook)


def _evaluate(target, tmp_path):
    drafter = tiny_drafter(target.config, block_size=2, mask_token_id=0, dtype=torch.float32, std=0.02)
    return evaluate(drafter, target, {"chat": [MESSAGES]}, max_new_tokens=6, out_dir=tmp_path, progress=False,
                    warmup=False, dtype="target")  # float32: the float32 tolerance


@pytest.mark.slow
def test_a_true_tie_passes_and_is_counted(smollm2_target, tmp_path):
    handle = _steer_verify(smollm2_target.model, 0.0)  # an exact tie: the verify picks TOKEN, plain the other
    try:
        report = _evaluate(smollm2_target, tmp_path)
    finally:
        handle.remove()
    figures = report["sets"]["chat"]
    assert figures["identical_outputs"] == 0 and figures["near_ties"] == 1 and figures["near_tie_max_gap"] == 0.0
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["overall"]["near_ties"] == 1 and on_disk["unexplained_divergences"] == 0


@pytest.mark.slow
def test_a_forced_wrong_token_fails_naming_where(smollm2_target, tmp_path):
    handle = _steer_verify(smollm2_target.model, 5.0)  # TOKEN wins the verify by 5 logits: no tie
    try:
        with pytest.raises(lossless.LosslessError) as caught:
            _evaluate(smollm2_target, tmp_path)
    finally:
        handle.remove()
    message = str(caught.value)
    # token 0 comes from the prefill (one row, untouched); the first verify pass emits position 1
    assert "set 'chat' prompt 0 position 1" in message and "gap there is 5 " in message, message
    assert json.loads((tmp_path / "report.json").read_text())["unexplained_divergences"] == 1


def _spec(tokens, gaps):
    return SpecResult(tokens, [0] * len(tokens), 2, 1.0, False, gaps)


def test_the_verdict_reads_the_gap_at_the_first_divergence_only():
    plain = GenResult([5, 6, 7, 8], 1.0, False)
    near = _spec([5, 6, 9, 1], [3.0, 3.0, 0.1, 9.0])  # parts at index 2, where the gap is 0.1
    far = _spec([5, 9, 7, 8], [3.0, 2.0, 0.1, 0.1])  # parts at index 1, gap 2.0
    short = _spec([5, 6], [3.0, 3.0])  # ends early: parts at index 2, no gap there
    verdict = lossless.check({"s": ([near, far, short], [plain] * 3)}, 0.5, 0.0)
    assert verdict.near_ties == {"s": [0.1]}
    assert len(verdict.failures) == 2 and "prompt 1 position 1" in verdict.failures[0]
    assert "prompt 2 position 2" in verdict.failures[1]
    assert lossless.check({"s": ([far], [plain])}, 0.5, 0.7).failures == []  # sampled: no reference
    assert lossless.tolerance(torch.bfloat16) == 0.5 and lossless.tolerance(torch.float32) == 1e-3


def test_the_eval_dtype_auto_is_bf16_only_on_a_cpu_with_bf16_units(smollm2_target):
    from dflash_train.eval import precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    expected = torch.bfloat16 if precision.cpu_has_bf16() else torch.float32
    assert precision.resolve("auto", torch.float32, cpu) == expected
    assert precision.resolve("auto", torch.float64, cpu) == torch.float64  # a test's exact target stays exact
    assert precision.resolve("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert precision.resolve("target", torch.float32, cpu) == torch.float32
    drafter = tiny_drafter(smollm2_target.config, block_size=2, mask_token_id=0, dtype=torch.float32)
    target, cast = precision.cast_pair(smollm2_target, drafter, torch.bfloat16)
    assert target.dtype == torch.bfloat16 and next(cast.parameters()).dtype == torch.bfloat16
    assert smollm2_target.dtype == torch.float32 and next(drafter.parameters()).dtype == torch.float32  # copies
    assert precision.cast_pair(smollm2_target, drafter, torch.float32) == (smollm2_target, drafter)
