"""Target/drafter balance of a disaggregated run: who waits for whom, and the ratio that fixes it.

Each side times only its own compute over the first steps: CUDA events on GPU (an NCCL wait
stalls the stream, not the host, so host clocks would count waiting as work), the host clock on
CPU. At step `BALANCE_STEP` every rank shares its seconds per sequence (one all_gather_object on
the whole world, called by target and drafter ranks at the same step), and the main drafter rank
prints the measured rates and the target:drafter ratio that keeps both sides busy.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

BALANCE_FIRST, BALANCE_STEP = 2, 6  # skip step 1 (compilation), measure steps 2..5


class ComputeTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.counted_s = 0.0  # CPU: wall seconds; CUDA: seconds of finished event pairs folded in
        self.sequences = 0
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self, sequences: int) -> None:
        self.sequences += sequences
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._start, end))
            if len(self.events) > 64:  # a whole run would hold millions of events: fold finished ones
                finished = [e.query() for _, e in self.events]
                self.counted_s += sum(s.elapsed_time(e) for (s, e), f in zip(self.events, finished) if f) / 1000.0
                self.events = [pair for pair, f in zip(self.events, finished) if not f]
        else:
            self.counted_s += time.perf_counter() - self._start

    def seconds(self) -> float:
        """Compute time between start/stop pairs so far (waits for the GPU to reach the last stop)."""
        if self.cuda:
            torch.cuda.synchronize()
            return self.counted_s + sum(s.elapsed_time(e) for s, e in self.events) / 1000.0
        return self.counted_s

    def seconds_per_sequence(self) -> float:
        return self.seconds() / max(self.sequences, 1)


def in_window(step: int) -> bool:
    return BALANCE_FIRST <= step < BALANCE_STEP


def suggest_target_ranks(world: int, group_size: int, ratio: float) -> int:
    """Target ranks (whole groups) that keep both sides busy in `world` processes, `ratio` being
    the target groups needed per drafter rank: n groups and d drafters with n = ratio * d and
    n * group_size + d = world, rounded, at least one group and one drafter rank."""
    groups = round(world * ratio / (1 + group_size * ratio))
    return min((world - 1) // group_size, max(1, groups)) * group_size


def share_and_report(role: str, seconds_per_seq: float, topo, log, taps_bytes_per_seq: float = 0.0) -> dict | None:
    """Collective: every rank calls it once, at BALANCE_STEP. Returns the figures on the main rank."""
    gathered = [None] * topo.world_size
    dist.all_gather_object(gathered, (role, seconds_per_seq))
    if not topo.is_main:
        return None
    target_times = [s for r, s in gathered if r == "target"]
    # a pipelined group goes at its slowest stage's pace; tensor-parallel members all take the group's time
    t_target = max(target_times) if topo.pipeline else sum(target_times) / max(1, len(target_times))
    t_drafter = sum(s for r, s in gathered if r == "drafter") / max(1, sum(r == "drafter" for r, _ in gathered))
    ratio = t_target / max(t_drafter, 1e-12)  # target units (ranks, or groups of ranks) needed per drafter rank
    world, size = topo.world_size, topo.target_group_size
    suggested_targets = suggest_target_ranks(world, size, ratio)
    unit = "a target rank" if size == 1 else f"a target group of {size} ranks"
    log(f"balance: {unit} computes {1 / t_target:.2f} seq/s, a drafter rank trains {1 / t_drafter:.2f} "
        f"seq/s (steps {BALANCE_FIRST}-{BALANCE_STEP - 1}); both stay busy at target:drafter = {ratio:.2f}:1, "
        f"i.e. {suggested_targets} target + {world - suggested_targets} drafter ranks for {world} processes "
        f"(this run: {topo.num_target_ranks} + {topo.num_drafters}); at that rate each drafter rank receives "
        f"{taps_bytes_per_seq / t_drafter / 1e6:.1f} MB/s of taps")
    return {"target_seq_per_s": 1 / t_target, "drafter_seq_per_s": 1 / t_drafter, "ratio": ratio,
            "suggested_target_ranks": suggested_targets}


def bytes_per_sequence(mbs) -> float:
    """Bytes from the target per sequence of a step's micro-batches (every tensor of their bundles)."""
    sent = sum(t.numel() * t.element_size() for mb in mbs for t in mb.from_target.values())
    return sent / sum(mb.input_ids.shape[0] for mb in mbs)
