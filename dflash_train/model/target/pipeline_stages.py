"""Pipeline stages of a frozen target over a target group: each rank holds consecutive decoder layers.

Tensor parallelism needs an architecture whose TP plan shards its decoder layers and widths the
group size divides (gpt-oss's plan shards nothing). Stages need neither: rank s of a group of n
keeps decoder layers [start_s, end_s) (`stage_bounds`, balanced), plus the embedding, final norm and
lm_head (small beside the layers; every rank reads them as a plain target would). For each
micro-batch, stage 0 embeds the ids and runs its layers; stage s > 0 receives the hidden state and
the taps filled so far from stage s - 1, runs its layers on the hidden state (`inputs_embeds`:
rotary positions and masks are recomputed from the same attention mask), fills its tapped layers'
columns and passes both on; the last stage holds the whole taps (and the final hidden state when a
distillation loss needs it) and is the group's sender. Sends are blocking point-to-point (NCCL or
gloo): stage s starts the next micro-batch as soon as s + 1 took this one, so the stages overlap
over a step's micro-batches.

Tested against single-process taps: tests/model/target/test_pipeline_stages.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dflash_train.model.target.taps import check_layer_ids, hidden_state_index
from dflash_train.model.target.target import Target, _StopForward


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) decoder layers of each stage: consecutive, sizes differing by at most one, the
    larger stages first."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{num_layers} decoder layers cannot fill {stages} pipeline stages "
                         f"(topology.target_group_size): use at most {num_layers}")
    base, extra = divmod(num_layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def keep_stage_layers(hf_model: nn.Module, start: int, end: int) -> nn.Module:
    """Drop every decoder layer outside [start, end), in place (before the model moves to its
    device, so only the stage's layers reach it). The decoder's forward runs the layers it holds
    and picks each one's mask by `config.layer_types[i]` (sliding, hybrid targets), so the decoder
    gets its own config copy with the stage's slice of that list; the model's config stays whole."""
    decoder = hf_model.get_decoder()
    decoder.layers = nn.ModuleList(list(decoder.layers)[start:end])
    config = copy.copy(decoder.config)
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[start:end]
    decoder.config = config
    return hf_model


@dataclass
class PipelineStage(Target):
    """A Target holding decoder layers [start, end) of `total_layers`; `taps` takes part in the
    group's chain and returns the taps on the last stage only (None on the others)."""

    start: int = 0
    end: int = 0
    total_layers: int = 0
    prev_rank: int | None = None  # the previous stage's global rank; None on stage 0
    next_rank: int | None = None  # the next stage's; None on the last stage (the sender)

    @property
    def num_layers(self) -> int:
        return self.total_layers

    @torch.no_grad()
    def taps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids,
             return_last_hidden: bool = False):
        layer_ids = check_layer_ids(layer_ids, self.total_layers)
        b, seq_len, width = *input_ids.shape, self.hidden_size
        hidden_in, taps = self._receive(b, seq_len, width * len(layer_ids))
        mine = [(k, g) for k, g in enumerate(layer_ids) if self.start <= g < self.end]
        recorded: dict[int, torch.Tensor] = {}
        last_stage = self.next_rank is None
        run_to_norm = last_stage and return_last_hidden
        handles = [self._record_hook(g - self.start, recorded, stop=False) for _, g in mine]
        handles.append(self._record_hook(self.end - 1 - self.start, recorded, stop=not run_to_norm))
        try:
            out = self._run_stage(input_ids, attention_mask, hidden_in)
        except _StopForward:
            out = None
        finally:
            for h in handles:
                h.remove()
        for k, g in mine:  # recorded under local indices: layer g is this stage's layer g - start
            tap = recorded[hidden_state_index(g - self.start)]
            taps[..., k * width:(k + 1) * width] = self.final_norm(tap) if g == self.total_layers - 1 else tap
        if not last_stage:
            self._send(recorded[hidden_state_index(self.end - 1 - self.start)], taps)
            return None
        return (taps, out.last_hidden_state) if return_last_hidden else taps

    def _receive(self, b: int, seq_len: int, taps_width: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(hidden state entering this stage [b, S, H] or None on stage 0, taps so far [b, S, K*H])."""
        if self.prev_rank is None:
            return None, torch.zeros(b, seq_len, taps_width, dtype=self.dtype, device=self.device)
        taps = torch.empty(b, seq_len, taps_width, dtype=self.dtype, device=self.device)
        hidden = torch.empty(b, seq_len, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, src=self.prev_rank)
        dist.recv(taps, src=self.prev_rank)
        return hidden, taps

    def _send(self, hidden: torch.Tensor, taps: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), dst=self.next_rank)
        dist.send(taps, dst=self.next_rank)

    def _run_stage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   hidden_in: torch.Tensor | None):
        if hidden_in is None:
            return self._run_decoder(input_ids, attention_mask)
        position_ids = None
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (b, S), as stage 0's
        return self.decoder(inputs_embeds=hidden_in, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)


def as_stage(target: Target, group: list[int], rank: int) -> PipelineStage:
    """This rank's stage of `target` (loaded whole on the CPU): its layers kept, the rest dropped;
    `group` is the target group's global ranks in stage order."""
    total = target.num_layers
    stage = group.index(rank)
    start, end = stage_bounds(total, len(group))[stage]
    keep_stage_layers(target.model, start, end)
    return PipelineStage(model=target.model, tokenizer=target.tokenizer, name=target.name, start=start, end=end,
                         total_layers=total, prev_rank=group[stage - 1] if stage > 0 else None,
                         next_rank=group[stage + 1] if stage + 1 < len(group) else None)
