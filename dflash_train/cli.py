"""`dflash-train` command line: one subcommand per job, each a thin call into the package.

Every command ends with a verdict line (`dflash-train <cmd>: OK ...` or `... FAILED: cause`) and a
non-zero exit status on failure.
"""

from __future__ import annotations

import argparse
import sys


def _not_yet(name: str):
    def run(args: argparse.Namespace) -> int:
        print(f"dflash-train {name}: FAILED: not available yet in this version", flush=True)
        return 2

    return run


COMMANDS = {
    "train": "train a drafter (default: the embedded SmolLM2 + chitchat recipe)",
    "eval": "real speculative decoding: tau, per-position acceptance, speedup",
    "regenerate": "regenerate assistant responses with the target",
    "prepare": "write offline hidden-state shards",
    "doctor": "staged environment and compile diagnostics",
    "export": "export a drafter checkpoint (z-lab or speculators format)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-train", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(func=_not_yet(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # never hold progress back
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)
