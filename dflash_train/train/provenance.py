"""What a checkpoint was trained with, and the check that a resume continues the same training.

A checkpoint records fingerprints (`fingerprints`) of
  data       the training samples: their count and a digest of ids, lengths and
             loss-token counts of all, and the tokens of up to TOKENS_SAMPLED evenly spaced ones
  target     `describe_target`'s config hash and weights fingerprint (model/target_identity.py)
  tokenizer  vocabulary, special tokens and chat template
  drafter    the drafter's architecture (`DrafterConfig`)
  order      what fixes the sequence of global batches: train.seqs_per_step, train.seed,
             train.num_anchors (never overridable; the number of drafter ranks and
             train.micro_batch may change, see `ORDER_FIELDS`)
`Provenance` is Stateful: its `state_dict` is the fingerprints, its `load_state_dict` compares
them with this run's and refuses a resume that changed anything, naming what, unless the part is
in `train.allow_changed` (then a warning names it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from array import array

from dflash_train.config import RESUME_CHANGEABLE, RunConfig
from dflash_train.model.target_identity import describe_target

TOKENS_SAMPLED = 1024
ORDER_FIELDS = ("seqs_per_step", "seed", "num_anchors")  # train.*: the global batch sequence depends on them


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


def tokenizer_fingerprint(tokenizer) -> str:
    return _digest({"vocab": tokenizer.get_vocab(), "special": tokenizer.all_special_tokens,
                    "chat_template": getattr(tokenizer, "chat_template", None)})


def fingerprints(cfg: RunConfig, target, dcfg, train_samples: list) -> dict:
    info = describe_target(cfg.target.model, cfg.target.gguf_file)
    return {
        "data": data_fingerprint(train_samples),
        # contents only, not paths or specs: a moved or copied target or data file is the same one
        "target": {"config_sha256": info.config_sha256, "weights_fingerprint": info.weights_fingerprint},
        "tokenizer": {"sha256": tokenizer_fingerprint(target.tokenizer)},
        "drafter": {"sha256": _digest(dataclasses.asdict(dcfg))},
        "order": {f"train.{name}": getattr(cfg.train, name) for name in ORDER_FIELDS},
    }


def differences(saved: dict, current: dict) -> dict[str, list[str]]:
    """part -> the changed fields, as 'key: checkpoint -> now'."""
    changed = {}
    for part, now in current.items():
        before = saved.get(part)
        if before is None:
            continue  # a checkpoint of an older version lacks it: nothing to compare
        fields = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in sorted(set(before) & set(now))  # fields both record
                  if before[k] != now[k]]
        if fields:
            changed[part] = fields
    return changed


class ProvenanceMismatch(ValueError):
    """A resume would continue a different training than the checkpoint's."""


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
        refused = {part: fields for part, fields in changed.items() if part not in self.allow_changed}
        if "data" in changed and saved["data"].get("num_samples") != self.current["data"]["num_samples"]:
            refused["data"] = changed["data"] + ["the sample count cannot change (the data cursor counts "
                                                 "steps of that data); only their content, knowingly"]
        if refused:
            lines = [f"  {part}: {'; '.join(fields)}" for part, fields in refused.items()]
            fixable = [part for part in refused if part in RESUME_CHANGEABLE and part not in self.allow_changed]
            hint = (f"to resume anyway, knowingly: train.allow_changed={','.join(fixable)}" if fixable else "")
            fixed = [part for part in refused if part not in RESUME_CHANGEABLE]
            if fixed:
                hint += ("; " if hint else "") + (f"{', '.join(fixed)} cannot change on resume (the sequence of "
                                                  "global batches depends on it): use the checkpoint's values")
            raise ProvenanceMismatch("resume: this run differs from the checkpoint's:\n" + "\n".join(lines)
                                     + f"\n{hint}")
        for part, fields in changed.items():
            self.log(f"WARNING resume: {part} changed since the checkpoint (train.allow_changed): {'; '.join(fields)}")
