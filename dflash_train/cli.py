"""`dflash-train` command line: one subcommand per job, all over one typed config.

Every command takes `--recipe NAME`, `--print-config` and `section.field=value` overrides of the
config tree (dflash_train/config.py); its flags are aliases of config fields (`eval --drafter D
--target T` is `eval.drafter=D target.model=T`). The config is resolved as recipe, then flags, then
overrides; validated (dflash_train/validate.py) before anything heavy is loaded; then the command
runs (dflash_train/commands/). Every command ends with one verdict line, printed here:
`dflash-train <cmd>: OK ...` (exit 0; `WARNING ...` where it went on past something the user must
know), `dflash-train <cmd>: INTERRUPTED ...` (exit 3: stopped by a
signal; `train` names the checkpointed step and how to resume) or `dflash-train <cmd>: FAILED:
<cause>` (exit 2 for a config error, 1 otherwise). Errors written for users (a ValueError, a missing
file, or an error class with `readable = True`) print their message alone, others a traceback too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import traceback

from dflash_train import recipes
from dflash_train.commands import Verdict
from dflash_train.config import ConfigError, RunConfig
from dflash_train.overrides import apply_overrides, describe_type, field_docs, field_types, sections, settings

COMMANDS = {name: f"dflash_train.commands.{name}" for name in ("train", "eval", "regenerate", "prepare", "doctor",
                                                                  "export", "check", "plan")}


class _Parser(argparse.ArgumentParser):
    """Usage errors become ConfigErrors, so they end with the same verdict line as every failure."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see {self.prog} --help)")


def _command(name: str):
    return importlib.import_module(COMMANDS[name])


def base_config(recipe: str | None) -> RunConfig:
    return RunConfig() if recipe is None else recipes.get(recipe)


def config_help(cfg: RunConfig, shown: tuple[str, ...], docs: dict[str, str]) -> str:
    """The `shown` fields (a section name shows all of its fields) with their type, value in `cfg`
    and first doc paragraph."""
    lines = ["config fields this command reads (section.field=value; every field is accepted):"]
    for key, value, tp in settings(cfg):
        if key not in shown and key.split(".")[0] not in shown:
            continue
        lines.append(f"  {key} = {value!r}  [{describe_type(tp)}]")
        doc = docs.get(key, "").split("\n\n")[0].replace("\n", " ")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def build_parser(name: str, module) -> argparse.ArgumentParser:
    recipe_note = f"'{module.RECIPE}'" if module.RECIPE else "none: the defaults in config.py"
    parser = _Parser(prog=f"dflash-train {name}", description=module.__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog=config_help(base_config(module.RECIPE), module.READS, field_docs()))
    parser.add_argument("--recipe", default=module.RECIPE,
                        help=f"named run: {', '.join(recipes.RECIPES)} (default {recipe_note})")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    for i, alias in enumerate(module.ALIASES):
        if alias.const is not None:
            parser.add_argument(alias.flag, dest=f"alias_{i}", action="store_const", const=alias.const,
                                help=f"= {alias.key}={alias.const}")
        else:
            also = "".join(f" {o}" for o in alias.also)
            parser.add_argument(alias.flag, dest=f"alias_{i}", metavar=alias.key.split(".")[1].upper(),
                                help=f"= {alias.key}=...{also}")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides (last wins)")
    return parser


def resolve(name: str, argv: list[str]) -> tuple[RunConfig, bool]:
    """The command's config: recipe, then its flags, then the overrides; and whether to print it only."""
    module = _command(name)
    args = build_parser(name, module).parse_intermixed_args(argv)
    overrides = _positional(module, args)
    for i, alias in enumerate(module.ALIASES):
        value = getattr(args, f"alias_{i}")
        if value is not None:
            overrides += alias.overrides(value)
    return apply_overrides(base_config(args.recipe), overrides + list(args.overrides)), args.print_config


def _positional(module, args) -> list[str]:
    """A command's one positional argument (`check DRAFTER`) spells `module.POSITIONAL=<it>`: the
    words among the overrides that hold no `=`."""
    key = getattr(module, "POSITIONAL", None)
    words = [w for w in args.overrides if "=" not in w]
    if key is None or not words:
        return []
    if len(words) > 1:
        raise ConfigError(f"expected one {key.split('.')[-1]} argument, got {' '.join(words)}")
    args.overrides = [w for w in args.overrides if "=" in w]
    return [f"{key}={words[0]}"]


@contextlib.contextmanager
def _signals_for_a_command():
    """For the command's life: `kill -USR1 <pid>` prints every thread's stack and the command goes on
    (docs: where is a job?); SIGTERM and SIGHUP end it as Ctrl-C does, so whatever it was writing is
    removed (atomic.atomic_dir) and it ends with the INTERRUPTED verdict. `train` replaces the latter
    with its agreed stop (train/watch/stop.py)."""
    from dflash_train.diagnostics.watchdog import install_signal_stack_dump, remove_signal_stack_dump

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"{signal.Signals(signum).name}; nothing half-written was left")

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)} if main_thread else {}
    dumps = main_thread and install_signal_stack_dump()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if dumps:
            remove_signal_stack_dump()


def run_command(name: str, argv: list[str]) -> int:
    """Resolve, validate and run one command; print its verdict line; return the exit status."""
    with _signals_for_a_command():
        return _run_command(name, argv)


def _run_command(name: str, argv: list[str]) -> int:
    try:
        cfg, print_only = resolve(name, argv)
        if print_only:
            print(cfg.to_json(), flush=True)
            return 0
        module = _command(name)
        module.validate(cfg)
        outcome = module.run(cfg)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except KeyboardInterrupt as e:  # Ctrl-C, or a signal outside train's loop (train/watch/stop.py StopNow)
        print(f"dflash-train {name}: INTERRUPTED ({e or 'Ctrl-C'})", flush=True)
        return 3
    except Exception as e:  # noqa: BLE001 - every failure ends with a verdict and a non-zero exit
        return _failed(name, e)
    verdict = outcome if isinstance(outcome, Verdict) else Verdict(outcome)
    if not verdict.printed:
        print(f"dflash-train {name}: {verdict.status} {verdict.detail}".rstrip(), flush=True)
    return verdict.exit_code


def _failed(name: str, error: Exception) -> int:
    """Print the FAILED verdict (the message alone for errors written for users, else the traceback
    first); under torchrun exit at once, since peers may be blocked in a collective."""
    readable = isinstance(error, (ValueError, FileNotFoundError)) or getattr(error, "readable", False)
    if not readable:
        traceback.print_exc()
    cause = str(error) if readable else f"{type(error).__name__}: {error}"
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    where = f" on rank {os.environ.get('RANK', '0')}" if distributed else ""
    print(f"dflash-train {name}: FAILED{where}: {cause}", flush=True)
    code = 2 if isinstance(error, ConfigError) else 1
    if distributed and code == 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # torchrun then ends the job
    return code


def top_help() -> str:
    lines = [__doc__.strip(), "", "usage: dflash-train <command> [--recipe NAME] [--flags] [section.field=value ...]",
             "", "commands (dflash-train <command> --help lists its flags and config fields):"]
    lines += [f"  {name:<11} {_command(name).HELP}" for name in COMMANDS]
    lines += ["", "config sections and their fields (dflash_train/config.py):"]
    for name, cls in sections().items():
        lines.append(f"  {name:<9} {', '.join(field_types(cls))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # never hold progress back
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # for the processes we start
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(top_help(), flush=True)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"dflash-train: FAILED: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", flush=True)
        return 2
    return run_command(argv[0], argv[1:])
