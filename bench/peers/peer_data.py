"""Our recipe's samples and taps as speculators' offline training samples, and speculators' own loader.

speculators 0.9.0 trains from per-sample dicts (speculators/train/data.py, `BaseDataset`):
    hidden_states               [seq, taps x hidden]  the verifier's auxiliary layers, concatenated
    input_ids                   [seq]
    verifier_last_hidden_states [seq, hidden]         the verifier's last layer BEFORE its final norm
    loss_mask                   [seq]                 1 on the tokens to learn (assistant tokens)
    lengths, position_ids                             added by `BaseDataset.__getitem__`
packed by its `MultipackDistributedBatchSamplerV2` into rows of `total_seq_len` tokens and collated by its
`CollateFn`. Its DFlash-family models apply the verifier's final norm to `verifier_last_hidden_states`
(`verifier_lm_head(verifier_norm(h))`: vLLM captures the last layer before the norm).

Ours (data/regen_taps.py, the `gpu` recipe's regenerate + tap cache, memory-mapped): per sample the taps
[len, K x H] in the same layout (K taps of the target's layers, concatenated in order), the ids, the
assistant-token loss mask, and the target's last hidden state AFTER its final norm, y = w * x / rms(x).
RMS normalisation ignores the scale of its input, so y / w = x / rms(x) is a pre-norm state the verifier's
norm maps back to y exactly (up to its epsilon): that is what speculators is given, so its teacher logits
are the target's own (checked on the first batch by `check_teacher`).
"""

from __future__ import annotations

import torch

import peer_env

peer_env.install_stubs()  # before speculators.train.data (and in the loader's worker processes)

from speculators.train.data import BaseDataset, CollateFn  # noqa: E402
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2  # noqa: E402

FINAL_HIDDEN = "final_hidden"  # the cache's entry (data/regen_taps.py)


class RecipeSamples(BaseDataset):
    """The training split of our tapped samples (`Sample`s and their rows {"taps", "final_hidden"})."""

    def __init__(self, samples: list, rows: list[dict], norm_factor: torch.Tensor, max_len: int,
                 hidden_states_dtype: torch.dtype = torch.bfloat16):
        if not rows or FINAL_HIDDEN not in rows[0]:
            raise ValueError("the samples carry no target final hidden state: build the data with a distillation "
                             "loss (the gpu recipe's loss.kind=tv does), as speculators' losses need the teacher")
        if bool((norm_factor.float().abs() < 1e-6).any()):
            raise ValueError("the target's final norm has a zero weight: its pre-norm state cannot be recovered")
        self.samples, self.rows = samples, rows
        self.inverse_norm = 1.0 / norm_factor.detach().float().cpu()  # [H]
        super().__init__(max_len, hidden_states_dtype)

    def __len__(self) -> int:
        return len(self.samples)

    def _compute_approx_lengths(self) -> list[int]:
        return [len(s) for s in self.samples]

    def _get_raw_data(self, index: int) -> dict:
        sample, row = self.samples[index], self.rows[index]
        final = row[FINAL_HIDDEN]
        return {
            "hidden_states": row["taps"],  # [seq, K*H], the mapped cache's dtype
            "input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
            "verifier_last_hidden_states": (final.float() * self.inverse_norm).to(final.dtype),  # [seq, H]
            "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.long),
        }


def their_loader(dataset: RecipeSamples, total_seq_len: int, hidden_size: int, num_taps: int, seed: int,
                 num_workers: int, prefetch_factor: int) -> torch.utils.data.DataLoader:
    """speculators' `_setup_dataloader` for one process (its packing sampler, its collate, its worker count and
    prefetch, pinned memory), except that workers fork instead of spawn: the samples are memory-mapped, and a
    forked worker shares those pages where a spawned one would receive a pickled copy of the data."""
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=dataset.approx_lengths,
                                                 num_replicas=1, rank=0, seed=seed)
    workers = num_workers > 0
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, prefetch_factor=prefetch_factor if workers else None,
        pin_memory=torch.cuda.is_available(), persistent_workers=workers,
        multiprocessing_context="fork" if workers else None,
        collate_fn=CollateFn(total_seq_len, hidden_size, num_target_layers=num_taps,
                             dtype=dataset.hidden_states_dtype))


@torch.no_grad()
def check_teacher(model, dataset: RecipeSamples, index: int = 0) -> float:
    """Relative error of speculators' verifier norm on a converted sample against our stored final hidden
    state (module doc); over 2 % stops the run: its teacher would not be the target's."""
    norm = model.verifier_norm
    converted = dataset[index]["verifier_last_hidden_states"].to(norm.weight.device, torch.float32)
    want = dataset.rows[index][FINAL_HIDDEN].to(norm.weight.device, torch.float32)
    got = norm(converted).float()
    err = float((got - want).norm() / want.norm().clamp(min=1e-12))
    if err > 0.02:
        raise RuntimeError(f"speculators' verifier norm does not give back our target's final hidden state "
                           f"(relative error {err:.3f}): its teacher would not be the target's")
    return err
