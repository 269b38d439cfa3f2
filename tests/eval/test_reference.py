"""The public reference implementation (PyPI `dflash` 0.1.0, `dflash/model.py`) loads our exports and
drafts, step by step, the same tokens as our speculative decoding, for DFlash and DFlash 2, with a
non-causal sliding window that binds. Runs where the package installs (README test command:
`pip install --no-deps dflash==0.1.0`); float32, where the reference's and our arithmetic agree
barring exact ties (engine-formats.md B.2)."""

import dataclasses

import pytest
import torch

from dflash_train.eval import spec_decode
from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.export.hf_format import save_zlab
from tests.eval.eval_helpers import tiny_target

reference = pytest.importorskip("dflash.model", reason="the reference package `dflash` 0.1.0 is not installed")


def our_drafter(target_config, arch: str, window: int | None):
    cfg = drafter_config_from_target(target_config, num_layers=2, block_size=4, mask_token_id=96, num_taps=2,
                                     sliding_window=window, arch=arch)
    cfg = dataclasses.replace(cfg, selector_rank=8, selector_top_k=6)
    drafter = build_drafter(cfg)
    drafter.reset_parameters(std=0.3, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # off the identity: every convolution and codebook changes the drafts
        for name, p in drafter.named_parameters():
            if any(k in name for k in ("conv", "codebook", "hidden_projection")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return drafter.eval()


def recorded(obj, name: str, picks):
    """Wrap obj.name so every call's drafted tokens are appended to `picks`."""
    original = getattr(obj, name)

    def call(*args, **kwargs):
        out = original(*args, **kwargs)
        picks.append([int(t) for t in (out[0] if isinstance(out, tuple) else out).reshape(-1)])
        return out

    return call


@pytest.mark.parametrize("arch,window", [("dflash", None), ("dflash2", None), ("dflash2", 6)])
def test_the_reference_package_drafts_our_tokens(arch, window, tmp_path, monkeypatch):
    target = tiny_target(seed=0, dtype=torch.float32, layers=6)
    drafter = our_drafter(target.config, arch, window)
    out = save_zlab(drafter, tmp_path / "drafter", dtype=torch.float32)
    ref_cls = reference.DFlash2DraftModel if arch == "dflash2" else reference.DFlashDraftModel
    ref = ref_cls.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    prompt = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(3))  # longer than the window

    ours_drafts, ref_drafts = [], []
    monkeypatch.setattr(drafter, "propose", recorded(drafter, "propose", ours_drafts))
    ours = spec_decode.speculative_generate(target, drafter, target.get_input_embeddings().weight,
                                            target.get_output_embeddings().weight, drafter.config.target_layer_ids,
                                            prompt, 24, [])
    if arch == "dflash2":
        monkeypatch.setattr(ref, "propose", recorded(ref, "propose", ref_drafts))
    else:  # DFlash drafts the argmax of compute_logits
        original = ref.compute_logits
        monkeypatch.setattr(ref, "compute_logits",
                            lambda *a: (lambda z: (ref_drafts.append(z.argmax(-1).reshape(-1).tolist()), z)[1])(
                                original(*a)))
    got = reference.dflash_generate(ref, target, prompt, 24, None, temperature=0.0)[0, prompt.shape[1]:].tolist()
    assert got[:len(ours.tokens)] == ours.tokens  # lossless both: the target's greedy text
    # the reference shortens the last blocks to what max_new_tokens leaves; ours drafts whole blocks
    n = next((i for i, d in enumerate(ref_drafts) if len(d) < len(ours_drafts[0])), len(ref_drafts))
    assert n >= 5 and ref_drafts[:n] == ours_drafts[:n]  # the same proposal at every step
    assert len({tuple(d) for d in ours_drafts}) > 1  # not a constant draft
