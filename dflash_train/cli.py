"""`dflash-train` command line: one subcommand per job, each a thin call into the package.

Every command module defines `add_arguments(parser)` and `command(args) -> int`; the table below
maps names to modules, imported only when the command runs. Every command ends with a verdict
line (`dflash-train <cmd>: OK ...` or `dflash-train <cmd>: FAILED: <cause>`) and a non-zero exit
status on failure.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "train": ("dflash_train.train.command", "train a drafter (default: the embedded SmolLM2 recipe, on CPU)"),
    "eval": ("dflash_train.eval.command", "real speculative decoding: tau, per-position acceptance, speedup"),
    "regenerate": ("dflash_train.data.regenerate", "regenerate assistant responses with the target"),
    "prepare": ("dflash_train.data.shards", "write offline hidden-state shards"),
    "doctor": ("dflash_train.diagnostics.doctor", "staged environment and compile diagnostics"),
    "export": ("dflash_train.model.export_command", "export a drafter checkpoint (z-lab or speculators format)"),
    "plan": ("dflash_train.plan_command", "memory per process, layouts that fit, expected tokens/s"),
}


def _load(name: str):
    module_name, _ = COMMANDS[name]
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        if e.name != module_name:
            raise
        return None


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        module = _load(name) if name == selected else None
        if module is not None:
            module.add_arguments(p)
            p.set_defaults(func=module.command)
        elif name == selected:
            p.set_defaults(func=lambda args, n=name: _unavailable(n))
    return parser


def _unavailable(name: str) -> int:
    print(f"dflash-train {name}: FAILED: not available in this version", flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # never hold progress back
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # for the processes we start
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(selected)
    # overrides (section.field=value) may come after flags too: `train --resume train.max_steps=9`
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or not all("=" in e and not e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)
