"""What a checkpoint was trained with, and the check that a resume continues the same training.

A checkpoint records fingerprints (`fingerprints`) of
  data       the training samples: their count and a digest of ids, lengths and
             loss-token counts of all, and the tokens of up to TOKENS_SAMPLED evenly spaced ones
             (sample ids come from the content, never from a file name: data/rows.py)
  target     `describe_target`'s config hash and the sha256 of the whole weights
             (model/target/identity.py), plus the older sampled weights fingerprint
  tokenizer  vocabulary, special tokens and chat template (each digested apart)
  drafter    the drafter's architecture (`DrafterConfig`), field by field
  order      what fixes the sequence of global batches: train.seqs_per_step, train.seed,
             train.num_anchors (never overridable; the number of drafter ranks and
             train.micro_batch may change, see `ORDER_FIELDS`)
and the layout (topology mode, target and drafter ranks, micro-batch), which may change (an
elastic resume) and is only reported.
`Provenance` is Stateful: its `state_dict` is the fingerprints, its `load_state_dict` compares
them with this run's and refuses a resume that changed anything, naming the part and its field,
unless the part is in `train.allow_changed` (then a warning names it). A refusal suggests an
`allow_changed` value only where that value lets the resume go on: a drafter whose weights change
(another architecture, width or depth) is refused whatever `allow_changed` says, naming the tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from array import array

import torch.distributed as dist

from dflash_train.config import RESUME_CHANGEABLE, RunConfig
from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.drafter.config import DrafterConfig
from dflash_train.model.target.identity import describe_target

TOKENS_SAMPLED = 1024
ORDER_FIELDS = ("seqs_per_step", "seed", "num_anchors")  # train.*: the global batch sequence depends on them
DIGESTS = ("sha256",)  # summary fields: named only when no other field of their part explains the change
LAYOUT = "layout"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_fingerprint(samples: list) -> dict:
    digest = hashlib.sha256()
    for s in samples:
        digest.update(f"{s.id}|{len(s)}|{sum(s.loss_mask)};".encode())
    stride = max(1, len(samples) // TOKENS_SAMPLED)
    for s in samples[::stride]:
        digest.update(array("q", s.input_ids).tobytes())
    return {"num_samples": len(samples), "sha256": digest.hexdigest()[:16]}


def _tokenizer_parts(tokenizer) -> dict:
    return {"vocab": tokenizer.get_vocab(), "special": tokenizer.all_special_tokens,
            "chat_template": getattr(tokenizer, "chat_template", None)}


def tokenizer_fingerprint(tokenizer) -> str:
    return _digest(_tokenizer_parts(tokenizer))


def drafter_fields(dcfg) -> dict:
    """The drafter's architecture as plain values (`extra`, not part of its identity, left out)."""
    fields = {f.name: getattr(dcfg, f.name) for f in dataclasses.fields(dcfg) if f.compare}
    return json.loads(json.dumps(fields, default=str))


def _field_defaults(cls) -> dict:
    return json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(cls)
                                  if f.compare and f.default is not dataclasses.MISSING}, default=str))


UNRECORDED = {"drafter": _field_defaults(DrafterConfig)}
"""Per part, what a field a checkpoint predates is compared as: its default (a drafter setting added
since, a new head's, is then no change while it keeps its default)."""


def layout_of(cfg: RunConfig, topo) -> dict:
    return {"drafter_ranks": topo.num_drafters, "mode": topo.mode, "target_ranks": topo.num_target_ranks,
            "micro_batch": cfg.train.micro_batch}


def fingerprints(cfg: RunConfig, target, dcfg, train_samples: list, layout: dict | None = None, log=print) -> dict:
    info = describe_target(cfg.target.model, cfg.target.gguf_file, log=log)
    tokenizer = _tokenizer_parts(target.tokenizer)
    found = {
        "data": data_fingerprint(train_samples),
        # contents only, not paths or specs: a moved or copied target or data file is the same one
        "target": {"config_sha256": info.config_sha256, "weights_sha256": info.weights_sha256,
                   "weights_fingerprint": info.weights_fingerprint},
        "tokenizer": {"sha256": tokenizer_fingerprint(target.tokenizer),
                      **{name: _digest(part) for name, part in tokenizer.items()}},
        "drafter": drafter_fields(dcfg),  # every field named: no digest, so a field added later can default
        "order": {f"train.{name}": getattr(cfg.train, name) for name in ORDER_FIELDS},
    }
    return found | ({LAYOUT: layout} if layout else {})


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(saved: dict, current: dict) -> dict[str, list[str]]:
    """part -> the changed fields, as 'key: checkpoint -> now' (a digest only where no named
    field of its part changed)."""
    changed = {}
    for part, now in current.items():
        before = saved.get(part)
        if not isinstance(before, dict):
            continue  # a checkpoint of an older version lacks it: nothing to compare
        before = {**UNRECORDED.get(part, {}), **before}  # an older checkpoint's missing fields: their defaults
        keys = [k for k in now if k in before and before[k] != now[k]]  # fields both record, in their order
        named = [k for k in keys if k not in DIGESTS]
        fields = [f"{k}: {_shown(before[k])} -> {_shown(now[k])}" for k in (named or keys)]
        if fields:
            changed[part] = fields
    return changed


class ProvenanceMismatch(ValueError):
    """A resume would continue a different training than the checkpoint's."""


def check_ranks_agree(current: dict, topo, group) -> None:
    """Every rank read the same data, target, tokenizer and drafter (node-local disks: each node
    reads its own copies). Collective over `group`; raises naming the part and the ranks."""
    if not topo.distributed:
        return
    mine = {part: _digest(value) for part, value in current.items()}
    every = [None] * topo.world_size
    dist.all_gather_object(every, mine, group=group)
    differ = {part: [rank for rank, theirs in enumerate(every) if theirs[part] != every[topo.drafter_ranks[0]][part]]
              for part in mine}
    differ = {part: ranks for part, ranks in differ.items() if ranks}
    if differ:
        parts = "; ".join(f"{part} on ranks {ranks}" for part, ranks in differ.items())
        raise ProvenanceMismatch(f"ranks read different inputs than the main drafter rank {topo.drafter_ranks[0]}: "
                                 f"{parts} (on several nodes, each needs the same target and data.train files)")


def weight_shapes(fields: dict) -> dict | None:
    """{name: shape} of the weights of the drafter that `drafter_fields` describe (built on the meta
    device), or None where the record cannot be read back as a DrafterConfig (an older version's)."""
    import torch

    names = {f.name for f in dataclasses.fields(DrafterConfig)}
    try:
        cfg = DrafterConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items() if k in names})
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in build_drafter(cfg).state_dict().items()}
    except (TypeError, ValueError, KeyError):
        return None


def weights_change(saved: dict, current: dict) -> str:
    """How the drafter's weights differ between the checkpoint's record and this run's ("" if they do
    not, or cannot be told): a resume then cannot load them, whatever train.allow_changed says."""
    before, now = weight_shapes(saved.get("drafter") or {}), weight_shapes(current.get("drafter") or {})
    if before is None or now is None or before == now:
        return ""
    missing, unexpected = sorted(set(now) - set(before)), sorted(set(before) - set(now))
    reshaped = [k for k in now if k in before and now[k] != before[k]]
    parts = [f"{label} {names[:3]}{' ...' if len(names) > 3 else ''}" for label, names in
             (("new", missing), ("gone", unexpected), ("reshaped", reshaped)) if names]
    return "; ".join(parts)


def _count_changed(saved: dict, current: dict) -> bool:
    return saved.get("data", {}).get("num_samples") != current["data"]["num_samples"] and "data" in saved


def refusal(changed: dict[str, list[str]], refused: list[str], allowed: tuple[str, ...], count_changed: bool,
            reweighted: str = "") -> str:
    """The refusal's text: each refused part's fields, then what to do (an `allow_changed` value
    only when it would let the resume go on)."""
    lines = ["resume: this run differs from the checkpoint's:"]
    lines += [f"  {part}: {'; '.join(changed[part])}" for part in refused]
    fixed = [part for part in refused if part not in RESUME_CHANGEABLE]
    if "drafter" in refused and reweighted:
        lines.append(f"the drafter's weights change ({reweighted}): the checkpoint's cannot be loaded into it, "
                     "even with train.allow_changed=drafter; train it in a new train.out_dir, or resume with the "
                     "checkpoint's drafter settings")
        fixed.append("drafter")
    if "data" in refused and count_changed:
        lines.append("the sample count cannot change on resume (the data cursor walks that many samples): "
                     "data.train, its content, data.max_samples, data.max_len or data.min_loss_tokens changed; "
                     "resume with the checkpoint's data, or start a new run in a new train.out_dir")
        fixed.append("data")
    order = [part for part in fixed if part not in ("data", "drafter")]
    if order:
        lines.append(f"{', '.join(order)} cannot change on resume (the sequence of global batches depends on "
                     "it): use the checkpoint's values")
    if not fixed:
        value = ",".join(dict.fromkeys(list(allowed) + refused))
        lines.append(f"to resume anyway, knowingly: train.allow_changed={value}")
    return "\n".join(lines)


class Provenance:
    """Stateful: this run's fingerprints; loading a checkpoint's compares (see the module doc)."""

    def __init__(self, current: dict, allow_changed: tuple[str, ...], log):
        self.current, self.allow_changed, self.log = current, tuple(allow_changed), log
        self.checked = False

    def state_dict(self) -> dict:
        return self.current

    def load_state_dict(self, saved: dict) -> None:
        if self.checked:  # checked once, early (loop._prepare); restoring the states again changes nothing
            return
        self.checked = True
        changed = differences(saved, self.current)
        layout = changed.pop(LAYOUT, None)
        count_changed = _count_changed(saved, self.current)
        reweighted = weights_change(saved, self.current) if "drafter" in changed else ""
        refused = [part for part in changed if part not in self.allow_changed or (part == "data" and count_changed)
                   or (part == "drafter" and reweighted)]
        if refused:
            raise ProvenanceMismatch(refusal(changed, refused, self.allow_changed, count_changed, reweighted))
        for part, fields in changed.items():
            self.log(f"WARNING resume: {part} changed since the checkpoint (train.allow_changed): {'; '.join(fields)}")
        if layout:
            self.log(f"resume: the layout changed since the checkpoint ({'; '.join(layout)}): an elastic resume, "
                     "the same global batches continue (train.seqs_per_step is split over the new drafter ranks)")
