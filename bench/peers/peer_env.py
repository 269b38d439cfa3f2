"""Importing speculators 0.9.0 (the peer) where its data-pipeline dependencies are absent.

speculators imports, at package import time, modules only its online data pipeline and CLI front end call
(an OpenAI client for a vLLM server, HTTP clients, a CLI toolkit). The GPU image and CI lack them, and
the peer scripts never reach that code; where one is missing it is served as an inert stub (any attribute
is a MagicMock). Everything the peer runs (models, losses, optimizers, trainer config, collate, packing
sampler) is speculators' own, imported from the installed wheel.

Imported by the worker processes of the peer's DataLoader too (peer_data.py), before they unpickle
speculators' collate function.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

PIPELINE_ONLY = ("openai", "httpx", "aiohttp", "loguru", "typer", "click", "psutil", "datasets")
"""`datasets`: speculators' Arrow reader; dflash_train needs it only to read an HF dataset directory as
`data.train`, which the peer never reads (it takes the run's regenerate + tap cache)."""


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves inert modules for `roots` and their submodules."""

    def __init__(self, roots):
        self.roots = frozenset(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        from unittest import mock

        module = types.ModuleType(spec.name)
        module.__path__ = []

        def __getattr__(attr, _name=spec.name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return mock.MagicMock(name=f"{_name}.{attr}")

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


def install_stubs(roots=PIPELINE_ONLY) -> list[str]:
    """Stub the roots that are not installed (once per process); returns them."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return sorted(next(f for f in sys.meta_path if isinstance(f, _StubFinder)).roots)
    missing = [r for r in roots if r not in sys.modules and importlib.util.find_spec(r) is None]
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    return missing


def speculators_version() -> str | None:
    """speculators' version where it imports (with the stubs), else None."""
    if importlib.util.find_spec("speculators") is None:
        return None
    install_stubs()
    try:
        import speculators.train.cli  # noqa: F401 - the whole chain the peer uses
        from speculators.version import version
    except ImportError:
        return None
    return version
