"""Where a drafter rank's taps come from, and the target ranks' side of the pipeline.

  ColocatedSource   runs the target in this process, right before the drafter step
  RemoteSource      receives taps from target ranks by torch.distributed point-to-point; it posts
                    the receives of the next `prefetch` steps ahead so transfers overlap compute
  serve_taps        the loop of a target rank: compute taps, send them, at most `max_in_flight`
                    unacknowledged sends at a time (back-pressure)

All three walk the same `StepSampler`, so they agree on every micro-batch without messages.
Only the taps travel; the drafter rebuilds ids, masks and anchors from its own copy of the data.
"""

from __future__ import annotations

import collections
import time

import torch
import torch.distributed as dist

from dflash_train.train.balance import ComputeTimer
from dflash_train.train.batching import BatchPlan, MicroBatch, Sample, StepSampler, collate
from dflash_train.train.step import host_to_device
from dflash_train.train.topology import Topology


class CollateArgs:
    def __init__(self, seed: int, num_anchors: int, pad_multiple: int, max_len: int):
        self.seed, self.num_anchors, self.pad_multiple, self.max_len = seed, num_anchors, pad_multiple, max_len

    def __call__(self, samples: list[Sample], epoch: int) -> MicroBatch:
        return collate(samples, epoch, self.seed, self.num_anchors, self.pad_multiple, self.max_len)


def compute_taps(target, layer_ids, mb: MicroBatch, device) -> torch.Tensor:
    """Taps [b, S, K*H] of one micro-batch, contiguous, in the target's dtype."""
    with torch.no_grad():
        taps = target.taps(host_to_device(mb.input_ids, device), host_to_device(mb.attention_mask, device), layer_ids)
    return taps.contiguous()


class ColocatedSource:
    def __init__(self, samples, sampler: StepSampler, plan: BatchPlan, drafter_index: int, collate_fn,
                 target, layer_ids, device):
        self.samples, self.sampler, self.plan, self.index = samples, sampler, plan, drafter_index
        self.collate, self.target, self.layer_ids, self.device = collate_fn, target, layer_ids, device
        self.target_seconds = 0.0

    def next_step(self) -> tuple[int, list[MicroBatch]]:
        epoch, indices = self.sampler.next()
        mbs = [self.collate([self.samples[i] for i in mb], epoch) for mb in self.plan.for_drafter(indices, self.index)]
        start = time.perf_counter()
        for mb in mbs:
            mb.taps = compute_taps(self.target, self.layer_ids, mb, self.device)
        self.target_seconds += time.perf_counter() - start
        return epoch, mbs

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class StoredTapsSource:
    """Taps looked up per sample (in memory from regenerate+tap, or from offline shards), padded to
    the micro-batch length; no target forward during training."""

    def __init__(self, samples, sampler: StepSampler, plan: BatchPlan, drafter_index: int, collate_fn, taps_of,
                 dtype: torch.dtype):
        self.samples, self.sampler, self.plan, self.index = samples, sampler, plan, drafter_index
        self.collate, self.taps_of, self.dtype = collate_fn, taps_of, dtype

    def next_step(self) -> tuple[int, list[MicroBatch]]:
        epoch, indices = self.sampler.next()
        mbs = []
        for mb_indices in self.plan.for_drafter(indices, self.index):
            mb = self.collate([self.samples[i] for i in mb_indices], epoch)
            b, seq_len = mb.input_ids.shape
            rows = [self.taps_of(i) for i in mb_indices]
            mb.taps = torch.zeros(b, seq_len, rows[0].shape[-1], dtype=self.dtype)  # [b, S, K*H]
            for r, taps in enumerate(rows):
                n = min(seq_len, taps.shape[0])
                mb.taps[r, :n] = taps[:n].to(self.dtype)
            mbs.append(mb)
        return epoch, mbs

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class RemoteSource:
    """Drafter side of the disaggregated pipeline."""

    def __init__(self, samples, sampler: StepSampler, plan: BatchPlan, topo: Topology, collate_fn,
                 taps_width: int, dtype: torch.dtype, device, steps_left: int, prefetch: int = 1):
        self.samples, self.sampler, self.plan, self.topo = samples, sampler, plan, topo
        self.collate, self.taps_width, self.dtype, self.device = collate_fn, taps_width, dtype, device
        self.prefetch, self.steps_left = prefetch, steps_left  # never post a receive no target will send
        self.pending = collections.deque()  # (epoch, mbs, works, sampler state after the step)
        self.consumed_state = sampler.state_dict()
        self.wait_seconds = 0.0

    def _post_next(self) -> None:
        epoch, indices = self.sampler.next()
        d = self.topo.drafter_index
        mbs, works = [], []
        for m, mb_indices in enumerate(self.plan.for_drafter(indices, d)):
            mb = self.collate([self.samples[i] for i in mb_indices], epoch)
            mb.taps = torch.empty(*mb.input_ids.shape, self.taps_width, dtype=self.dtype, device=self.device)
            source = self.topo.target_ranks[(d * self.plan.accum + m) % len(self.topo.target_ranks)]
            works.append(dist.irecv(mb.taps, src=source))
            mbs.append(mb)
        self.pending.append((epoch, mbs, works, self.sampler.state_dict()))

    def next_step(self) -> tuple[int, list[MicroBatch]]:
        while len(self.pending) < self.prefetch + 1 and self.steps_left > 0:
            self._post_next()
            self.steps_left -= 1
        epoch, mbs, works, state_after = self.pending.popleft()
        start = time.perf_counter()
        for work in works:
            work.wait()
        self.wait_seconds += time.perf_counter() - start
        self.consumed_state = state_after
        return epoch, mbs

    def state_dict(self) -> dict:
        return self.consumed_state

    def load_state_dict(self, state: dict, steps_done: int = 0) -> None:
        if self.pending:
            raise RuntimeError("load_state_dict after receives were posted")
        self.sampler.load_state_dict(state)
        self.consumed_state = state
        self.steps_left -= steps_done


def serve_taps(target, layer_ids, samples, sampler: StepSampler, plan: BatchPlan, topo: Topology, collate_fn,
               device, num_steps: int, max_in_flight: int, heartbeat=None, stop_requested=None,
               on_step=None, timer=None) -> dict:
    """Target rank loop: for each step, the micro-batches routed here (i % T == this rank)."""
    pending: collections.deque = collections.deque()
    me = topo.target_ranks.index(topo.rank)
    busy = ComputeTimer(device)  # CUDA events: timing must not make the host wait for the GPU
    wait = 0.0
    sent_bytes = 0
    for k in range(num_steps):
        if stop_requested is not None and stop_requested():
            break
        epoch, indices = sampler.next()
        for i, mb_indices in enumerate(plan.micro_batches(indices)):
            if i % len(topo.target_ranks) != me:
                continue
            mb = collate_fn([samples[j] for j in mb_indices], epoch)
            busy.start()
            if timer is not None:
                timer(k + 1, "start", 0)
            taps = compute_taps(target, layer_ids, mb, device)
            if timer is not None:
                timer(k + 1, "stop", len(mb_indices))
            busy.stop(len(mb_indices))
            # no stream sync: ProcessGroupNCCL makes its stream wait for this one before the send,
            # so the host goes on to collate and launch the next forward while this one runs
            pending.append((dist.isend(taps, dst=topo.drafter_ranks[i // plan.accum]), taps))
            sent_bytes += taps.numel() * taps.element_size()
            start = time.perf_counter()
            while len(pending) > max_in_flight:  # back-pressure: the drafters set the pace
                pending.popleft()[0].wait()
            wait += time.perf_counter() - start
        if heartbeat is not None:
            heartbeat("target: sent step")
        if on_step is not None:
            on_step(k + 1)
    while pending:
        pending.popleft()[0].wait()
    return {"busy_s": busy.seconds(), "wait_s": wait, "sent_bytes": sent_bytes}
