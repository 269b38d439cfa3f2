"""Export: the serving artefact of a trained drafter, in the z-lab format (model/drafter/export/hf_format.py),
checked as the engines will load it (model/drafter/export/check.py) before it is swapped in.

Its own file because the check reads checkpoints with hf_format's loader: hf_format writes and reads,
check reads, and this file, above both, writes then checks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_train.atomic import atomic_dir
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.export.draft_vocab import DRAFT_VOCAB
from dflash_train.model.drafter.export.hf_format import (EXPORT_WHAT, is_export, refuse_non_finite, write_export_marker,
                                                         zlab_files)
from dflash_train.model.drafter.export.check import ServingContractError, check_drafter
from dflash_train.model.drafter.export.serve import engine_notes
from dflash_train.model.drafter.heads.architectures import head
from dflash_train.model.target.identity import TargetInfo, describe_target
from dflash_train.model.target.subset import read_lm_head


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, target_model: str | None = None,
                   gguf_file: str | None = None, dtype: torch.dtype = torch.bfloat16, log=print,
                   draft_vocab: torch.Tensor | None = None, training_input: dict | None = None) -> Path:
    """The serving artefact: the z-lab format with the training target recorded in
    `dflash_config.trained_against` (and `draft_vocab`, the ids of its training softmax, in the engines'
    reduced form where its head's engines serve one: the target's lm_head rows and d2t; else as DRAFT_VOCAB,
    said), written beside `out_dir`, checked as the engines will load it, and swapped in only when it passes
    (with EXPORT_MARKER, written last).

    Nothing is written when the weights are not finite (`NonFiniteWeights`) or `out_dir` holds
    something other than an earlier export of ours (`atomic.DestinationInUse`); a drafter that would be
    served wrong raises `ServingContractError` (a ValueError listing every failure) and leaves nothing.
    A target whose files are not on this machine (a disaggregated run's drafter node) is not recorded,
    and that is said."""
    out_dir = Path(out_dir)
    refuse_non_finite(drafter.state_dict(), str(out_dir), "nothing was written")
    target = None
    if target_model is not None:
        try:
            target = describe_target(target_model, gguf_file)
        except (FileNotFoundError, OSError, ValueError) as e:
            log(f"export: WARNING: the training target is not recorded and not checked: {e}")
    lm_head = _target_lm_head(drafter, draft_vocab, target, dtype, log)
    files = zlab_files(drafter, dtype, None, target.provenance() if target else None, draft_vocab, training_input,
                       lm_head)
    with atomic_dir(out_dir, replaceable=is_export, what=EXPORT_WHAT) as staged:
        for name, write in files.items():
            write(staged / name)
        failures = check_drafter(staged, target, trained=drafter, target_lm_head=lm_head)
        if failures:
            raise ServingContractError(out_dir, failures, written=False)
        write_export_marker(staged)
    log(f"export: {out_dir} passes the serving check" + (f" against {target.name} ({target.path})" if target else ""))
    for note in engine_notes(out_dir):
        log(f"export: note: {note}")
    return out_dir


def _target_lm_head(drafter: DFlashDrafter, draft_vocab: torch.Tensor | None, target: TargetInfo | None,
                    dtype: torch.dtype, log) -> torch.Tensor | None:
    """The target's lm_head (in the export's dtype), to copy the draft vocabulary's rows from into the reduced
    form; None, said, where the head's engines serve no reduced form (the draft vocabulary stays in DRAFT_VOCAB for
    our eval) or the target's files are not on this machine."""
    if draft_vocab is None:
        return None
    reduced, what = head(drafter.config.arch).export.reduced_vocab, f"{draft_vocab.numel()}-token draft vocabulary"
    if not reduced.exported:
        log(f"export: the {what} stays in {DRAFT_VOCAB} (our eval reads it, no engine does); the export drafts over "
            f"the whole lm_head: {reduced.not_exported}")
        return None
    if target is None:
        log(f"export: WARNING: the {what} stays in {DRAFT_VOCAB}, which no engine reads: the target's lm_head is not "
            f"here to copy its rows from; export again with the target (`dflash-train export --target T`)")
        return None
    ignored = f"; ignored by {' and '.join(reduced.ignored_by)}, which drafts over the whole lm_head" \
        if reduced.ignored_by else ""
    log(f"export: the {what} written as served by {' and '.join(reduced.served_by)} (draft_vocab_size, lm_head.weight: "
        f"the target's rows, d2t){ignored}")
    return read_lm_head(target.path, dtype)
