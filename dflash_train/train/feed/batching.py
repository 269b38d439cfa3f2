"""Which samples each step uses, and how they are split into micro-batches and routed.

Every rank holds the same tokenized sample list and the same `StepSampler`, so every rank knows,
without talking, the sample ids of every micro-batch of every step: drafter ranks know which taps
they will receive and their shapes; target ranks know what to compute and for whom. That is what
makes the disaggregated run reproduce the colocated one exactly.

Step s of epoch e takes `seqs_per_step` samples from a permutation seeded by (seed, e). The
drafter rank d gets the d-th slice of them, cut into `accum` micro-batches of `micro_batch`.
Micro-batch i = d * accum + m of a step is computed by target rank i % T.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from dflash_train.data.anchors import anchor_generator, draw_anchors, eligible_anchors
from dflash_train.data.records import Sample


@dataclass(frozen=True)
class BatchPlan:
    seqs_per_step: int
    micro_batch: int
    num_drafters: int

    def __post_init__(self):
        per_rank = self.micro_batch * self.num_drafters
        if self.seqs_per_step % per_rank:
            raise ValueError(f"train.seqs_per_step={self.seqs_per_step} is not a multiple of micro_batch "
                             f"({self.micro_batch}) x drafter ranks ({self.num_drafters})")

    @property
    def accum(self) -> int:
        """Micro-batches per drafter rank per step (gradient accumulation)."""
        return self.seqs_per_step // (self.micro_batch * self.num_drafters)

    def micro_batches(self, step_indices: list[int]) -> list[list[int]]:
        """All micro-batches of a step, ordered by (drafter, micro index); i = d * accum + m."""
        mb = self.micro_batch
        return [step_indices[i * mb:(i + 1) * mb] for i in range(len(step_indices) // mb)]

    def for_drafter(self, step_indices: list[int], drafter_index: int) -> list[list[int]]:
        all_mbs = self.micro_batches(step_indices)
        return all_mbs[drafter_index * self.accum:(drafter_index + 1) * self.accum]


class StepSampler:
    """Deterministic (epoch, step) -> sample indices, with an exact resumable cursor."""

    def __init__(self, num_samples: int, seqs_per_step: int, seed: int):
        if num_samples < seqs_per_step:
            raise ValueError(f"{num_samples} training samples cannot fill one step of {seqs_per_step} sequences")
        self.num_samples, self.seqs_per_step, self.seed = num_samples, seqs_per_step, seed
        self.epoch, self.step_in_epoch = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.seqs_per_step  # the last partial step is dropped

    def _permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))

    def next(self) -> tuple[int, list[int]]:
        """(epoch, indices) of the next step; advances the cursor."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        start = self.step_in_epoch * self.seqs_per_step
        indices = self._permutation(self.epoch)[start:start + self.seqs_per_step].tolist()
        self.step_in_epoch += 1
        return self.epoch, indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        """The cursor holds no world size: any number of drafter ranks continues the same global
        batches (elastic resume)."""
        if state["num_samples"] != self.num_samples:
            raise ValueError(f"resume: the checkpoint's data had {state['num_samples']} samples, this run has "
                             f"{self.num_samples}; resume needs the same data")
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]

    @property
    def steps_done(self) -> int:
        """Steps drawn since the start of the run (the cursor counts from epoch 0, step 0)."""
        return self.epoch * self.steps_per_epoch + self.step_in_epoch


def padded_length(lengths: list[int], multiple: int, max_len: int) -> int:
    """Pad to a multiple (few distinct shapes -> few compiles); never beyond max_len."""
    longest = max(lengths)
    return min(max_len, -(-longest // multiple) * multiple) if multiple > 1 else longest


@dataclass
class MicroBatch:
    """Host tensors of one micro-batch, plus the target's tensors by name (`from_target`, filled
    by a taps source following the run's `TapsSpec`: "taps" [b, S, K*H], ...)."""

    ids: list[str]
    input_ids: torch.Tensor  # [b, S] int64, right-padded with 0
    loss_mask: torch.Tensor  # [b, S] int64
    attention_mask: torch.Tensor  # [b, S] int64
    anchors: torch.Tensor  # [b, N] int64, sorted
    keep: torch.Tensor  # [b, N] bool
    from_target: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [b, S, width]

    @property
    def taps(self) -> torch.Tensor:
        return self.from_target["taps"]


class SampleTensors:
    """A sample's tokens and loss mask as tensors and its eligible anchors (`eligible_anchors`), built once.

    Why: a step's 32 samples rebuilt from tuples each step cost the host ~3 ms (`torch.tensor` of a list,
    then the eligible positions; this 2-core box) in a step that waits for the host on a GPU (PERF.md 8)."""

    def __init__(self, sample: Sample):
        self.input_ids = torch.tensor(sample.input_ids, dtype=torch.long)
        self.loss_mask = torch.tensor(sample.loss_mask, dtype=torch.long)
        self.eligible = eligible_anchors(self.loss_mask)
        self.eligible_list = self.eligible.tolist()

    def eligible_before(self, n: int) -> torch.Tensor:
        """The eligible anchors of the sample cut to its first n tokens: t with t + 1 < n (a prefix)."""
        return self.eligible[:bisect.bisect_left(self.eligible_list, n - 1)]


def _cached(cache: dict, sample: Sample) -> SampleTensors:
    """The sample's tensors, keyed by the object (ids may repeat in a user's data), built on first use."""
    entry = cache.get(id(sample))
    if entry is None or entry[0] is not sample:
        entry = cache[id(sample)] = (sample, SampleTensors(sample))
    return entry[1]


def collate(samples: list[Sample], epoch: int, seed: int, num_anchors: int, pad_multiple: int,
            max_len: int, cache: dict | None = None) -> MicroBatch:
    """Right-pad samples to a common length and draw their anchors for this epoch. `cache` (a dict kept
    across calls, filled as samples come: `_cached`) builds each sample's tensors once."""
    cache = {} if cache is None else cache
    seq_len = padded_length([len(s) for s in samples], pad_multiple, max_len)
    b = len(samples)
    input_ids = torch.zeros(b, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(b, seq_len, dtype=torch.long)
    attention = torch.zeros(b, seq_len, dtype=torch.long)
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    keep = torch.zeros(b, num_anchors, dtype=torch.bool)
    for row, s in enumerate(samples):
        n = min(len(s), seq_len)
        attention[row, :n] = 1
        tensors = _cached(cache, s)
        input_ids[row, :n] = tensors.input_ids[:n]
        loss_mask[row, :n] = tensors.loss_mask[:n]
        anchors[row], keep[row] = draw_anchors(tensors.eligible_before(n), num_anchors,
                                               anchor_generator(seed, epoch, s.id))
    return MicroBatch([s.id for s in samples], input_ids, loss_mask, attention, anchors, keep)


HOST_FIELDS = ("input_ids", "loss_mask", "anchors", "keep")  # what the step reads besides the target's tensors


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy without a stream sync: a copy from pageable host memory waits for the GPU to drain
    (CUDA stages it), which left the GPU idle at the start of every step; pinned + non_blocking
    does not wait."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device(mb: MicroBatch, device) -> dict:
    """The step's inputs on the device: the host fields and every tensor from the target, by name."""
    tensors = {k: getattr(mb, k) for k in HOST_FIELDS} | mb.from_target
    return {k: host_to_device(t, device) for k, t in tensors.items()}
