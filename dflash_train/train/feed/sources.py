"""Where a drafter rank's taps come from (`TapsSource`), and the target ranks' side (`TargetServer`).

  ColocatedSource   runs the target in this process, right before the drafter step
  StoredSource      gathers the taps of a step's samples (the regenerate+tap cache packed on the GPU or in
                    host memory, feed/packed.py; or offline shards, read per sample)
  RemoteSource      receives taps from target ranks by torch.distributed point-to-point; it posts
                    the receives of the next `prefetch` steps ahead so transfers overlap compute
  TargetServer      a target rank: compute taps, send them, at most `max_in_flight` unacknowledged
                    sends at a time (back-pressure). In a target group (a target sharded over
                    several ranks) every member computes and only the group's sender sends.

All walk the same `StepSampler`, so they agree on every micro-batch without messages. What
travels is the named bundle of `taps.TapsSpec`; the drafter rebuilds ids, masks and anchors from
its own copy of the data. `build_source` is the one place that picks the route.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from dflash_train.train.feed.balance import ComputeTimer
from dflash_train.train.feed.batching import BatchPlan, MicroBatch, Sample, StepSampler, collate
from dflash_train.train.feed.packed import PackedRows
from dflash_train.train.feed.taps import StoredRows, TapsSpec, target_tensors
from dflash_train.train.parallel.topology import Topology

Rows = StoredRows | PackedRows  # per-sample stored tensors: fetched one by one (shards) or packed end to end


class TapsSource(Protocol):
    """A drafter rank's micro-batches with the target's tensors filled in; Stateful (its data
    cursor, from which the steps already taken follow). `step_tokens`: the tokens of the last
    step's global batch (all drafter ranks' micro-batches), the same whatever the layout."""

    step_tokens: int

    def next_step(self) -> tuple[int, list[MicroBatch]]: ...

    def held_out(self) -> list[MicroBatch]:
        """The held-out micro-batches with their tensors (empty on ranks that do not evaluate).
        Called once, before the first step."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CollateArgs:
    def __init__(self, seed: int, num_anchors: int, pad_multiple: int, max_len: int):
        self.seed, self.num_anchors, self.pad_multiple, self.max_len = seed, num_anchors, pad_multiple, max_len
        self.cache: dict = {}  # batching.SampleTensors of each sample, built as the epochs first reach it

    def __call__(self, samples: list[Sample], epoch: int) -> MicroBatch:
        return collate(samples, epoch, self.seed, self.num_anchors, self.pad_multiple, self.max_len, self.cache)


@dataclass(frozen=True)
class Feed:
    """What every source walks: the samples, the sampler's plan and how micro-batches are built."""

    samples: list[Sample]
    plan: BatchPlan
    collate: CollateArgs
    held_out: list[MicroBatch]  # train.micro_batch samples each, deterministic anchors (simulated tau)
    spec: TapsSpec
    seed: int

    def sampler(self) -> StepSampler:
        """A fresh cursor at step 0; every rank's walks the same steps."""
        return StepSampler(len(self.samples), self.plan.seqs_per_step, self.seed)


class SampledSource:
    """The sampler cursor every source shares: micro-batches of this drafter rank, state_dict."""

    def __init__(self, feed: Feed, drafter_index: int):
        self.feed, self.sampler, self.index = feed, feed.sampler(), drafter_index

    step_tokens = 0  # tokens in the last step's global batch, on every drafter rank alike

    def _draw(self) -> tuple[int, list[list[int]], list[MicroBatch]]:
        epoch, indices = self.sampler.next()
        groups = self.feed.plan.for_drafter(indices, self.index)
        self.drawn_tokens = sum(min(len(self.feed.samples[i]), self.feed.collate.max_len) for i in indices)
        return epoch, groups, [self.feed.collate([self.feed.samples[i] for i in g], epoch) for g in groups]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class ColocatedSource(SampledSource):
    def __init__(self, feed: Feed, drafter_index: int, target, layer_ids, device):
        super().__init__(feed, drafter_index)
        self.target, self.layer_ids, self.device = target, layer_ids, device

    def next_step(self) -> tuple[int, list[MicroBatch]]:
        epoch, _, mbs = self._draw()
        self.step_tokens = self.drawn_tokens
        for mb in mbs:
            mb.from_target = target_tensors(self.target, self.layer_ids, mb, self.device, self.feed.spec)
        return epoch, mbs

    def held_out(self) -> list[MicroBatch]:
        for mb in self.feed.held_out:
            mb.from_target = target_tensors(self.target, self.layer_ids, mb, self.device, self.feed.spec)
        return self.feed.held_out


class StoredSource(SampledSource):
    """Stored rows padded to the micro-batch length; no target forward during training."""

    def __init__(self, feed: Feed, drafter_index: int, rows: Rows, held_out_rows: Rows, device: torch.device):
        super().__init__(feed, drafter_index)
        self.rows, self.held_out_rows = rows, held_out_rows
        self.pinned = device.type == "cuda"  # host rows gathered straight into memory a GPU copy reads

    def next_step(self) -> tuple[int, list[MicroBatch]]:
        epoch, groups, mbs = self._draw()
        self.step_tokens = self.drawn_tokens
        for mb, group in zip(mbs, groups):
            mb.from_target = self.rows.padded(group, mb.input_ids.shape[1], self.feed.spec, self.pinned)
        return epoch, mbs

    def held_out(self) -> list[MicroBatch]:
        first = 0  # in order: the held-out micro-batches hold the held-out samples 0, 1, ... in turn
        for mb in self.feed.held_out:
            rows = list(range(first, first + len(mb.ids)))
            mb.from_target = self.held_out_rows.padded(rows, mb.input_ids.shape[1], self.feed.spec, self.pinned)
            first += len(mb.ids)
        return self.feed.held_out


class RemoteSource(SampledSource):
    """Drafter side of the disaggregated pipeline."""

    def __init__(self, feed: Feed, topo: Topology, device, total_steps: int, prefetch: int = 1, stop_step=None):
        super().__init__(feed, topo.drafter_index)
        self.topo, self.device, self.prefetch, self.total_steps = topo, device, prefetch, total_steps
        self.stop_step = stop_step or (lambda: None)  # the agreed stop (train/watch/stop.py): no receive beyond it
        self.pending = collections.deque()  # (epoch, mbs, works, sampler state after the step, tokens)
        self.consumed_state = self.sampler.state_dict()
        self.posted = 0  # never post a receive no target will send
        self.wait_seconds = 0.0

    def _post_next(self) -> None:
        epoch, _, mbs = self._draw()
        works = []
        for m, mb in enumerate(mbs):
            mb.from_target = self.feed.spec.empty(*mb.input_ids.shape, self.device)
            senders = self.topo.sender_ranks  # one per target group (= every target rank with groups of 1)
            source = senders[(self.index * self.feed.plan.accum + m) % len(senders)]
            works += [dist.irecv(t, src=source) for t in mb.from_target.values()]
        self.pending.append((epoch, mbs, works, self.sampler.state_dict(), self.drawn_tokens))
        self.posted += 1

    def next_step(self) -> tuple[int, list[MicroBatch]]:
        last = min(self.total_steps, self.stop_step() or self.total_steps)
        while len(self.pending) < self.prefetch + 1 and self.posted < last:
            self._post_next()
        epoch, mbs, works, state_after, self.step_tokens = self.pending.popleft()
        start = time.perf_counter()
        for work in works:
            work.wait()
        self.wait_seconds += time.perf_counter() - start
        self.consumed_state = state_after
        return epoch, mbs

    def held_out(self) -> list[MicroBatch]:
        """The first target group's sender sends the held-out tensors to the main drafter rank, once."""
        if not self.topo.is_main:
            return []
        for mb in self.feed.held_out:
            mb.from_target = self.feed.spec.empty(*mb.input_ids.shape, self.device)
            for t in mb.from_target.values():
                dist.recv(t, src=self.topo.sender_ranks[0])
        return self.feed.held_out

    def state_dict(self) -> dict:
        return self.consumed_state

    def load_state_dict(self, state: dict) -> None:
        if self.pending:
            raise RuntimeError("load_state_dict after receives were posted")
        super().load_state_dict(state)
        self.consumed_state = state
        self.posted = self.sampler.steps_done


def build_source(feed: Feed, topo: Topology, target, layer_ids, device, total_steps: int,
                 stored: tuple[Rows, Rows] | None, stop_step=None) -> TapsSource:
    """The taps route of a drafter rank: stored rows when the data came with them, else the
    target in this process, else the target ranks (`stop_step()`: the agreed stop, or None)."""
    if stored is not None:
        return StoredSource(feed, topo.drafter_index, *stored, device)
    if topo.target_in_process:
        return ColocatedSource(feed, topo.drafter_index, target, layer_ids, device)
    return RemoteSource(feed, topo, device, total_steps, stop_step=stop_step)


class TargetServer:
    """A target rank: for each step, the micro-batches routed to its group (i % groups == its
    group), computed, and sent to their drafter rank by the group's sender; the other members run
    the same sharded forwards (tensor parallel) or their stage's layers (pipeline, passing the
    hidden state to the next stage) and send nothing to drafters. The caller's loop calls
    `serve_step` once per step."""

    def __init__(self, feed: Feed, topo: Topology, target, layer_ids, device, max_in_flight: int):
        self.feed, self.sampler, self.topo = feed, feed.sampler(), topo
        self.target, self.layer_ids, self.device, self.max_in_flight = target, layer_ids, device, max_in_flight
        self.me = topo.target_group_index
        self.pending: collections.deque = collections.deque()
        self.busy = ComputeTimer(device)  # CUDA events: timing must not make the host wait for the GPU
        self.balance = ComputeTimer(device)  # the balance window's share of `busy`
        self.wait_s, self.sent_bytes = 0.0, 0

    def send_held_out(self) -> None:
        """The first target group computes the held-out tensors; its sender sends them to the main
        drafter rank."""
        if self.me != 0:
            return
        for mb in self.feed.held_out:
            tensors = target_tensors(self.target, self.layer_ids, mb, self.device, self.feed.spec)
            for t in tensors.values() if self.topo.is_sender else ():
                dist.send(t, dst=self.topo.drafter_ranks[0])

    def serve_step(self, timed: bool = False, poison: bool = False) -> None:
        """Compute and send this rank's micro-batches of the next step; `timed` also counts them
        in the balance timer; `poison` puts a NaN in the first one's taps (fault injection)."""
        epoch, indices = self.sampler.next()
        for i, group in enumerate(self.feed.plan.micro_batches(indices)):
            if i % self.topo.num_target_groups != self.me:
                continue
            mb = self.feed.collate([self.feed.samples[j] for j in group], epoch)
            timers = [self.busy, self.balance] if timed else [self.busy]
            for timer in timers:
                timer.start()
            tensors = target_tensors(self.target, self.layer_ids, mb, self.device, self.feed.spec)
            if poison and tensors is not None:
                tensors["taps"].view(-1)[0], poison = float("nan"), False
            for timer in reversed(timers):
                timer.stop(len(group))
            # no stream sync: ProcessGroupNCCL makes its stream wait for this one before the send,
            # so the host goes on to collate and launch the next forward while this one runs
            if not self.topo.is_sender:
                continue  # a group member: its share of the forward is done, the sender sends
            dst = self.topo.drafter_ranks[i // self.feed.plan.accum]
            for t in tensors.values():
                self.pending.append((dist.isend(t, dst=dst), t))
                self.sent_bytes += t.numel() * t.element_size()
            start = time.perf_counter()
            while len(self.pending) > self.max_in_flight * len(tensors):  # back-pressure: drafters set the pace
                self.pending.popleft()[0].wait()
            self.wait_s += time.perf_counter() - start

    def finish(self) -> dict:
        """Wait for the last sends; busy and waiting seconds, bytes sent."""
        while self.pending:
            self.pending.popleft()[0].wait()
        return {"busy_s": self.busy.seconds(), "wait_s": self.wait_s, "sent_bytes": self.sent_bytes}
