"""Code requests for training: Python functions of the running interpreter's standard library, offline.

Why: a drafter learns the target's answers to what it is asked in training, and the embedded corpus
(chitchat, assistant requests) and the prompts the target writes itself hold almost no code, so code is
where a drafter trained on them drafts worst. Every Python installation ships a few thousand
documented functions in its standard library (PSF license): enough to ask for code without a dataset
or a download.

Each prompt is one user turn built from one public function (`def` line and docstring, no body): a
request to implement it, explain it, test it or use it, phrased by one of `REQUESTS`, chosen by a hash
of the function's place (file and qualified name), so the same function always gets the same request.
The target writes the answers (`regenerate`), as for every other source. No stdlib code is executed.

The set depends on the interpreter's version (its stdlib); `fingerprint` names its contents, so a data
cache built under one Python is never read under another.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
import textwrap
from functools import lru_cache
from pathlib import Path

from dflash_train.data.records import Conversation

MIN_DOCSTRING_CHARS = 40
"""Shorter docstrings ("Return self.") say too little to ask for an implementation."""
MAX_STUB_CHARS = 1500
"""Longer stubs are whole manuals, not requests."""
SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
                          "__pycache__", "ensurepip", "pydoc_data"})
"""Test suites (functions that assert, not functions to write), bundled apps and installed packages."""

REQUESTS = (
    "Complete this Python function:\n```python\n{stub}\n```",
    "Implement the following function in Python.\n\n```python\n{stub}\n```",
    "Write the body of this function:\n\n{stub}",
    "Can you write this Python function for me? Here is its signature and docstring:\n```python\n{stub}\n```",
    "Fill in the implementation, keeping the signature:\n```python\n{stub}\n```",
    "Explain what a function with this docstring should do, then write it.\n```python\n{stub}\n```",
    "Write a few unit tests for this function:\n```python\n{stub}\n```",
    "Show me how to call this function with an example:\n```python\n{stub}\n```",
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def has_sources(root: Path | None = None) -> bool:
    """Whether `root` (default: the stdlib) holds Python sources at all: checked before anything heavy loads."""
    return any((root or stdlib_dir()).glob("*.py"))


def _stub(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> str | None:
    """The function's source from its `def` line through its docstring, dedented: decorators and body
    left out, the signature and docstring literal as written (escapes, raw strings and line breaks kept).
    None where that is not a function on its own (a body on the docstring's line)."""
    docstring = node.body[0]
    stub = textwrap.dedent("\n".join(lines[node.lineno - 1:docstring.end_lineno]))
    try:
        (parsed,) = ast.parse(stub).body
    except SyntaxError:
        return None
    return stub if len(parsed.body) == 1 else None


def _public_functions(path: Path, root: Path) -> list[tuple[str, str]]:
    """(place, stub) of each public documented function of one file: `place` is `file:qualified.name`."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # the stdlib ships a few deliberately broken files (bad-syntax fixtures)
    out: list[tuple[str, str]] = []
    lines = text.split("\n")

    def visit(parent: ast.AST, prefix: str) -> None:
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                    stub = _stub(node, lines)
                    if stub and len(stub) <= MAX_STUB_CHARS:
                        out.append((f"{path.relative_to(root).as_posix()}:{prefix}{node.name}", stub))

    visit(tree, "")
    return out


@lru_cache(maxsize=4)
def stdlib_functions(root: Path | None = None) -> tuple[tuple[str, str], ...]:
    """(place, stub) of every public documented function under `root` (default: this interpreter's
    stdlib), in path order; identical stubs (one docstring copied into several modules) kept once."""
    root = root or stdlib_dir()
    seen, out = set(), []
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        for place, stub in _public_functions(path, root):
            if stub not in seen:
                seen.add(stub)
                out.append((place, stub))
    return tuple(out)


def _request(place: str, stub: str) -> str:
    pick = int(hashlib.sha256(place.encode()).hexdigest()[:8], 16) % len(REQUESTS)
    return REQUESTS[pick].format(stub=stub)


def code_train_conversations(seed: int = 0, max_samples: int | None = None,
                             root: Path | None = None) -> list[Conversation]:
    """One-turn code requests, a seeded sample of `max_samples` (all of them if None or more than exist)."""
    functions = list(stdlib_functions(root))
    if not functions:
        raise FileNotFoundError(f"data source 'code': no documented public function under {root or stdlib_dir()} "
                                "(this interpreter ships no standard-library sources)")
    rng = random.Random(seed)
    picked = rng.sample(functions, min(max_samples or len(functions), len(functions)))
    return [Conversation(f"code-{place}", [{"role": "user", "content": _request(place, stub)}])
            for place, stub in picked]


@lru_cache(maxsize=4)
def fingerprint(root: Path | None = None) -> str:
    """The source's contents as a short hash, for cache keys (another Python: another stdlib)."""
    digest = hashlib.sha256()
    for place, stub in stdlib_functions(root):
        digest.update(_request(place, stub).encode())
    return "code:sha256:" + digest.hexdigest()[:16]
