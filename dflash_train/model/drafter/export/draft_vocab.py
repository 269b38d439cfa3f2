"""A drafter's draft vocabulary: the tokens it proposes from (the ids of its training softmax,
`loss.train_vocab`), in the form the engines serve and in the form our checkpoints keep.

Served form, written by an export where the head's engines serve it (`Export.reduced_vocab.exported`,
model/drafter/head.py; EAGLE-3's layout, which vLLM reads for the DFlash family:
vllm/model_executor/models/qwen3_dflash.py DFlashQwen3ForCausalLM.__init__ / load_weights / compute_logits):
- config.json `draft_vocab_size` n; `vocab_size` stays the target's (logits are scattered back to it);
- model.safetensors `lm_head.weight` [n, H], the drafter's own head: the target's rows at those tokens (DFlash's
  lm_head is the target's, frozen; without it vLLM would share the target's whole one), and `d2t` [n] int64 with
  target id = draft id + d2t[draft id] (vLLM loads it as `draft_id_to_target_id`; `t2d` it skips).
speculators' reduced checkpoints (RedHat's) carry the same tensors, plus `t2d`.

Kept form: `draft_vocab.json` ({"ids": [...]}) beside the weights, which no engine reads: a training checkpoint's
`drafter/` (the target's lm_head is not there to copy), an export of a head no engine serves reduced, and exports
written before the served form (still read). JSON, not safetensors, so engines that load every *.safetensors of
the directory never see it. An export of ours holds one of the two forms, never both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_train.model.drafter.heads.architectures import head

DRAFT_VOCAB = "draft_vocab.json"
"""The kept form's file: the ids the drafter was trained to propose (module doc)."""
SIZE_KEY = "draft_vocab_size"
"""config.json key of the served form: the rows of the drafter's own lm_head."""
D2T, T2D, LM_HEAD = "d2t", "t2d", "lm_head.weight"
VOCAB_TENSORS = (LM_HEAD, D2T, T2D)
"""Tensors of a reduced vocabulary beside the drafter's own: none of them is a parameter of our drafter."""


@dataclass(frozen=True)
class DraftVocab:
    """A directory's draft vocabulary, as read (`read_draft_vocab`)."""

    ids: torch.Tensor
    """[n] token id of each draft id (the served form's order; the kept form's sorted ids)."""
    rows: torch.Tensor | None
    """[n, H] the directory's own lm_head rows (the served form), or None: the target's rows at `ids` (the kept form,
    or read without rows)."""
    source: str
    """Where it was read: `d2t` and `lm_head.weight` of the named safetensors, or draft_vocab.json."""
    served: bool
    """In the served form: what vLLM drafts over for a head it serves reduced. The kept form no engine reads."""

    @property
    def size(self) -> int:
        return int(self.ids.numel())


def draft_vocab_file(ids: torch.Tensor | list[int]) -> dict:
    """The content of DRAFT_VOCAB for token ids."""
    return {"ids": [int(i) for i in ids], "source": "the drafter's training softmax (loss.train_vocab)"}


def served_tensors(ids: torch.Tensor, target_lm_head: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The served form's tensors for token ids [n]: the target's lm_head rows at them (in `dtype`) and d2t, draft
    ids in token order (as speculators' `t2d` mask orders them)."""
    ids = torch.sort(ids.to("cpu", torch.long)).values
    return {LM_HEAD: target_lm_head.detach()[ids].to("cpu", dtype).contiguous(),
            D2T: (ids - torch.arange(ids.numel())).contiguous()}


def served_config(ids: torch.Tensor | None) -> dict:
    """The served form's config.json key, or nothing."""
    return {} if ids is None else {SIZE_KEY: int(ids.numel())}


def load_draft_vocab(model_dir: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The token ids [n] of a directory's draft vocabulary in either form, or None where it has none or it
    holds every token (drafting over all rows is the plain head); a malformed one is a ValueError naming the
    file and the field."""
    vocab = read_draft_vocab(model_dir, vocab_size, rows=False)
    return None if vocab is None else vocab.ids


def read_draft_vocab(model_dir: str | Path, vocab_size: int, rows: bool = True) -> DraftVocab | None:
    """A directory's draft vocabulary: the served form where its weights carry `d2t` (what vLLM reads), else the
    kept form's draft_vocab.json, else None; None too where it holds every token. `rows`: also read the
    served form's lm_head rows (the eval drafts with them, as vLLM does)."""
    model_dir = Path(model_dir)
    vocab = read_served(model_dir, vocab_size, rows)
    if vocab is None and (model_dir / DRAFT_VOCAB).is_file():
        vocab = DraftVocab(_read_kept(model_dir / DRAFT_VOCAB, vocab_size), None, str(model_dir / DRAFT_VOCAB), False)
    return None if vocab is None or vocab.size == vocab_size else vocab


def _read_kept(path: Path, vocab_size: int) -> torch.Tensor:
    try:
        ids = json.loads(path.read_text())["ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: expected a JSON object with an 'ids' list of token ids ({type(e).__name__}: {e})")
    if not isinstance(ids, list):
        raise ValueError(f"{path}: field 'ids' must be a list of token ids, not {type(ids).__name__}")
    bad = [i for i in ids if type(i) is not int or not 0 <= i < vocab_size]  # bool is no token id
    if not ids or bad:
        raise ValueError(f"{path}: field 'ids' must list token ids in [0, {vocab_size}); "
                         f"{'it is empty' if not ids else f'bad entries: {bad[:5]}'}")
    return torch.tensor(sorted(set(ids)), dtype=torch.long)


def tensor_files(model_dir: Path) -> dict[str, tuple[Path, str]]:
    """Tensor name (without a `model.` prefix) -> (its safetensors file, its stored name), from the headers."""
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({name.removeprefix("model."): (path, name) for name in f.keys()})
    return out


def read_tensor(where: tuple[Path, str]) -> torch.Tensor:
    with safe_open(str(where[0]), "pt") as f:
        return f.get_tensor(where[1])


def read_served(model_dir: Path, vocab_size: int, rows: bool = True) -> DraftVocab | None:
    """The served form of a directory's draft vocabulary (module doc), None where its weights carry no `d2t`; a
    ValueError naming the file and the field where vLLM could not read it as a draft vocabulary."""
    files = tensor_files(model_dir)
    declared = _declared_size(model_dir, vocab_size)
    if D2T not in files:
        if declared is not None:
            raise ValueError(f"{model_dir / 'config.json'}: {SIZE_KEY} {declared} of {vocab_size} tokens, but no "
                             f"*.safetensors there holds {D2T} (target id = draft id + d2t[draft id])")
        return None
    path = files[D2T][0]
    ids = token_ids(read_tensor(files[D2T]), vocab_size, f"{path}: {D2T}")
    if declared not in (None, ids.numel()):
        raise ValueError(f"{model_dir / 'config.json'}: {SIZE_KEY} {declared}, but {path.name} {D2T} maps "
                         f"{ids.numel()} draft ids")
    if LM_HEAD not in files:
        raise ValueError(f"{path}: {D2T} without {LM_HEAD}: vLLM would draft over the target's whole lm_head and "
                         "scatter its logits through d2t (a reduced checkpoint ships its own lm_head)")
    head_rows = read_tensor(files[LM_HEAD]) if rows else None
    if head_rows is not None and head_rows.shape[0] != ids.numel():
        raise ValueError(f"{files[LM_HEAD][0]}: {LM_HEAD} has {head_rows.shape[0]} rows, {D2T} {ids.numel()} entries")
    return DraftVocab(ids, head_rows, f"{D2T} and {LM_HEAD} of {path.name}", True)


def _declared_size(model_dir: Path, vocab_size: int) -> int | None:
    """config.json's draft_vocab_size where it declares fewer tokens than the vocabulary, else None."""
    try:
        size = json.loads((model_dir / "config.json").read_text()).get(SIZE_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    if size is not None and (type(size) is not int or size <= 0):
        raise ValueError(f"{model_dir / 'config.json'}: {SIZE_KEY} {size!r} is not a positive integer")
    return size if size is not None and size != vocab_size else None


def token_ids(d2t: torch.Tensor, vocab_size: int, source: str) -> torch.Tensor:
    """The token id [n] of each draft id (draft id + d2t[draft id]); a ValueError naming `source` where d2t is no
    1-D integer tensor, maps outside the vocabulary, or maps two draft ids to one token."""
    if d2t.dim() != 1 or d2t.numel() == 0 or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"{source}: expected a non-empty 1-D integer tensor (target id = draft id + d2t[draft id]), "
                         f"not {d2t.dtype} {list(d2t.shape)}")
    ids = torch.arange(d2t.numel()) + d2t.long()
    outside = torch.nonzero((ids < 0) | (ids >= vocab_size)).flatten()
    if outside.numel():
        raise ValueError(f"{source}: draft ids {outside[:5].tolist()} map to tokens {ids[outside[:5]].tolist()}, "
                         f"outside the vocabulary [0, {vocab_size})")
    unique, counts = torch.unique(ids, return_counts=True)
    if unique.numel() != ids.numel():
        token = int(unique[counts > 1][0])
        raise ValueError(f"{source}: draft ids {torch.nonzero(ids == token).flatten().tolist()} all map to token "
                         f"{token}: each draft id must map to its own token")
    return ids


def as_whole_vocabulary(tensors: dict[str, torch.Tensor], cfg, source: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (names without `model.`) as our drafter of `cfg` holds them: the reduced vocabulary's
    own tensors left out (the eval reads them with `read_draft_vocab`), and the head's `draft_rows` (DSpark's
    markov_w2 with a row per draft token) put back at their tokens, zeros elsewhere (never read: the logits of
    tokens outside the draft vocabulary are -inf)."""
    out = {k: v for k, v in tensors.items() if k not in VOCAB_TENSORS}
    if D2T not in tensors:
        return out
    ids = token_ids(tensors[D2T], cfg.vocab_size, f"{source}: {D2T}")
    for name in head(cfg.arch).export.reduced_vocab.draft_rows:
        t = out.get(name)
        if t is not None and t.shape[0] == ids.numel() != cfg.vocab_size:
            whole = t.new_zeros((cfg.vocab_size, *t.shape[1:]))
            whole[ids] = t
            out[name] = whole
    return out


def served_rows(shapes: dict[str, tuple[int, ...]], cfg) -> int | None:
    """The rows of the reduced draft vocabulary a directory's weights carry (`shapes`: name -> shape) for a head
    whose engines serve one, else None (a whole-vocabulary drafter: an lm_head there is the engines' to ignore)."""
    plain = {name.removeprefix("model."): shape for name, shape in shapes.items()}
    if D2T not in plain or LM_HEAD not in plain or not head(cfg.arch).export.reduced_vocab.exported:
        return None
    rows = int(plain[LM_HEAD][0])
    return None if rows == cfg.vocab_size else rows


def served_form_problems(model_dir: str | Path, d: dict, cfg, target_lm_head: torch.Tensor | None = None) -> list:
    """(field, what an engine would do) for each way a directory's reduced draft vocabulary would be served wrong:
    on a head no engine serves reduced, a d2t or lm_head vLLM cannot read as trained (d2t mapping each draft id to
    its own token inside the vocabulary, config.json's draft_vocab_size, lm_head [n, H]), and with
    `target_lm_head`, lm_head rows other than the target's at those tokens. [] where the directory drafts over the
    whole vocabulary."""
    model_dir = Path(model_dir)
    if D2T not in tensor_files(model_dir) and d.get(SIZE_KEY) in (None, cfg.vocab_size):
        return []
    reduced = head(cfg.arch).export.reduced_vocab
    if not reduced.exported:
        return [(SIZE_KEY, f"a reduced draft vocabulary on a {cfg.arch} drafter: {reduced.not_exported}; export it "
                           "over the whole vocabulary")]
    try:
        vocab = read_draft_vocab(model_dir, cfg.vocab_size)
    except ValueError as e:
        return [(D2T, str(e))]
    if vocab is None:
        return []
    if list(vocab.rows.shape) != [vocab.size, cfg.hidden_size]:
        return [(LM_HEAD, f"{list(vocab.rows.shape)}: a drafter {cfg.hidden_size} wide with {vocab.size} draft "
                          f"tokens needs [{vocab.size}, {cfg.hidden_size}]")]
    return [] if target_lm_head is None else _rows_problems(vocab, target_lm_head)


def _rows_problems(vocab: DraftVocab, target_lm_head: torch.Tensor) -> list:
    """The reduced lm_head's rows against the target's at the tokens d2t maps them to (in the stored dtype: an
    export copies them exactly); vLLM drafts with the stored rows (engine_view.engine_draft_logits)."""
    want = target_lm_head.detach().cpu()[vocab.ids].to(vocab.rows.dtype)
    differ = torch.nonzero((want != vocab.rows).any(-1)).flatten()
    if not differ.numel():
        return []
    i = int(differ[0])
    return [(LM_HEAD, f"{differ.numel()} of its {vocab.size} rows are not the target's rows at the tokens d2t maps "
                      f"them to (first: draft id {i} -> token {int(vocab.ids[i])}): vLLM drafts with these rows, the "
                      "drafter trained with the target's")]
