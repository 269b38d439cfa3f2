"""The `code` training source: stdlib functions as code requests, checked on a hand-written tree (every
rule against a known answer) and on this interpreter's stdlib (stubs parse back to the same signature and
docstring as the source they came from)."""

from __future__ import annotations

import ast
import textwrap

import pytest

from dflash_train import recipes, validate
from dflash_train.config import DataConfig
from dflash_train.data import code_requests
from dflash_train.data.conversations import read_conversations
from dflash_train.data.dataset import read_train_conversations, train_key
from dflash_train.data.text import read_documents
from dflash_train.data.train_spec import parse_train_spec

DOC = "Return the sum of a and b, both integers, as an integer."


def _write(root, rel, source):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source), encoding="utf-8")


@pytest.fixture
def tree(tmp_path):
    _write(tmp_path, "mod.py", f'''
        import functools

        def add(a, b=1, *args, key: int = 0, **kw) -> int:
            """{DOC}"""
            return a + b

        def _private(x):
            """{DOC}"""

        def short(x):
            """Too short."""

        @functools.lru_cache
        async def fetch(url):
            """{DOC}
            Second line of the docstring.
            """

        class Box:
            def size(self):
                """{DOC}"""
                return 0

        class _Hidden:
            def size(self):
                """{DOC} hidden"""
        ''')
    _write(tmp_path, "pkg/copy.py", f'''
        def add(a, b=1, *args, key: int = 0, **kw) -> int:
            """{DOC}"""
            return b + a
        ''')
    _write(tmp_path, "test/test_mod.py", f'def test_add():\n    """{DOC}"""\n')
    _write(tmp_path, "broken.py", "def broken(:\n")
    code_requests.stdlib_functions.cache_clear()
    code_requests.fingerprint.cache_clear()
    yield tmp_path
    code_requests.stdlib_functions.cache_clear()
    code_requests.fingerprint.cache_clear()


def test_public_documented_functions_in_path_order_duplicates_once(tree):
    got = code_requests.stdlib_functions(tree)
    assert [place for place, _ in got] == ["mod.py:add", "mod.py:fetch", "mod.py:Box.size"]
    stubs = dict(got)
    assert stubs["mod.py:add"] == f'def add(a, b=1, *args, key: int = 0, **kw) -> int:\n    """{DOC}"""'
    assert stubs["mod.py:fetch"].startswith("async def fetch(url):\n") and "@" not in stubs["mod.py:fetch"]
    assert "    Second line of the docstring." in stubs["mod.py:fetch"]
    assert "return" not in "".join(stubs.values())  # no body leaks into a request


def test_requests_are_seeded_one_user_turn_and_hold_the_stub(tree):
    convs = code_requests.code_train_conversations(seed=0, root=tree)
    assert sorted(c.id for c in convs) == sorted(f"code-{p}" for p, _ in code_requests.stdlib_functions(tree))
    for conv in convs:
        (message,) = conv.messages
        assert message["role"] == "user"
        stub = dict(code_requests.stdlib_functions(tree))[conv.id.removeprefix("code-")]
        assert stub in message["content"]
    again = code_requests.code_train_conversations(seed=0, root=tree)
    assert [(c.id, c.messages) for c in again] == [(c.id, c.messages) for c in convs]
    assert len(code_requests.code_train_conversations(seed=0, max_samples=2, root=tree)) == 2


def test_an_empty_tree_is_refused_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        code_requests.code_train_conversations(root=tmp_path)


def test_validation_refuses_the_source_where_the_stdlib_has_no_sources(tmp_path, monkeypatch):
    cfg = recipes.gpu()
    assert code_requests.has_sources() and not validate.data_problems(cfg)
    monkeypatch.setattr(code_requests, "stdlib_dir", lambda: tmp_path)  # a slim image: bytecode only
    (tmp_path / "os.pyc").write_bytes(b"")
    (problem,) = validate.data_problems(cfg)
    assert "source 'code'" in problem and str(tmp_path) in problem
    assert not validate.data_problems(recipes.default())  # a mix without the source does not ask for it


def test_fingerprint_follows_the_contents(tree, tmp_path_factory):
    first = code_requests.fingerprint(tree)
    other = tmp_path_factory.mktemp("other")
    _write(other, "mod.py", f'def mul(a, b):\n    """{DOC}"""\n')
    assert code_requests.fingerprint(other) != first
    assert code_requests.fingerprint(tree) == first


def _lines(function: ast.AST) -> list[str]:
    """A docstring's lines without their indentation (dedenting a literal changes only whitespace, and
    `ast.get_docstring` keeps some of it where an escaped line break sets the margin)."""
    return [line.strip() for line in ast.get_docstring(function).strip().split("\n")]


def test_stdlib_stubs_parse_back_to_their_signature_and_docstring():
    functions = code_requests.stdlib_functions()
    assert len(functions) > 1000  # any CPython ships thousands of documented public functions
    sources = {}
    for place, stub in functions[::25]:
        rel, qualname = place.split(":")
        if rel not in sources:
            sources[rel] = ast.parse((code_requests.stdlib_dir() / rel).read_text(encoding="utf-8"))
        originals = [n for n in ast.walk(sources[rel]) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == qualname.rsplit(".", 1)[-1] and ast.get_docstring(n)]
        (parsed,) = ast.parse(stub).body
        assert any(ast.dump(parsed.args) == ast.dump(o.args) and _lines(parsed) == _lines(o) for o in originals), place
        assert len(stub) <= code_requests.MAX_STUB_CHARS


def test_code_is_a_named_source_of_a_mix_and_keys_the_cache_by_content():
    assert parse_train_spec("default:0.5,code:0.5", 10) == [("default", 5), ("code", 5)]
    convs, bad = read_conversations("code", max_samples=7)
    assert len(convs) == 7 and all(c.id.startswith("code-") for c in convs) and not bad.total
    cfg = DataConfig(train="default:0.5,code:0.5", max_samples=10)
    mixed, _ = read_train_conversations(cfg, None, "unused", None, seed=0, log=lambda *_: None)
    assert sum(c.id.startswith("code-") for c in mixed) == 5 and len(mixed) == 10
    assert code_requests.fingerprint() in train_key(cfg)
    docs, _ = read_documents("code", max_samples=3)  # a base model continues the same requests as text
    assert [d.text for d in docs] == [c.messages[0]["content"] for c in read_conversations("code", max_samples=3)[0]]
