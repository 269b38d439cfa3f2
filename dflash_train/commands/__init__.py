"""One module per `dflash-train` subcommand: its flags (each an alias of config fields) and the call
into the library. `cli.py` builds the parser, resolves the config (recipe, then flags, then
`section.field=value` overrides), validates it, runs the command and prints the verdict.

A command module defines:
    HELP       one line for `dflash-train --help`
    RECIPE     the recipe used without `--recipe` (None: the defaults in config.py)
    READS      the config sections and fields it reads, listed by its `--help` (all are accepted)
    ALIASES    its flags, each one a spelling of config overrides
    validate(cfg)  raises ConfigError before anything heavy is loaded
    run(cfg)       returns the verdict's detail (or a Verdict); raises on failure
Command modules import the library inside `run` only, so `--help`, `--print-config` and a config error
answer before any model, data or device is touched. torch itself is imported with the config tree
(its drafter section takes the heads' settings from the head files, model/drafter/heads/architectures.py, which are
torch modules: about 2 s on a 2-core CPU), but nothing initialises a device before `run`, and the
doctor's parent process never does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    """A flag that spells `key=<its value>` (or `key=const` for a switch), plus `also` overrides."""

    flag: str
    key: str
    const: str | None = None
    also: tuple[str, ...] = ()

    def overrides(self, value: str) -> list[str]:
        return [f"{self.key}={value}", *self.also]


@dataclass(frozen=True)
class Verdict:
    """How a command ended: `dflash-train <cmd>: <status> <detail>`, exit status `exit_code`.
    `printed`: the library printed the line itself (the doctor, whose line is also its JSON report's)."""

    detail: str
    status: str = "OK"
    exit_code: int = 0
    printed: bool = False


def device_of(cfg, fallback: str | None = None) -> str:
    """topology.device, else `fallback`, else cuda when there is one, else cpu."""
    if cfg.topology.device or fallback:
        return cfg.topology.device or fallback
    import torch  # only commands that run a model ask (see the module docstring)

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_configured_target(cfg, fallback_device: str | None = None, check_tokenizer=None):
    """The target as `cfg.target` describes it, on `device_of(cfg)`; `check_tokenizer(tokenizer)` runs
    before the weights load (`load_target`)."""
    from dflash_train.model.target.load import load_target  # imports torch (see the module docstring)

    return load_target(cfg.target.model, cfg.target.gguf_file, cfg.target.dtype, device_of(cfg, fallback_device),
                       cfg.target.trust_remote_code, check_tokenizer=check_tokenizer)
