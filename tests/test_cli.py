"""The command line: one config for every command (flags are aliases of fields), --recipe,
--print-config and --help everywhere, validation before anything is loaded, one verdict handler."""

from __future__ import annotations

import json
import sys
import types
import typing

import pytest

from dflash_train import cli
from dflash_train.commands import Alias, Verdict
from dflash_train.config import ConfigError, RunConfig
from dflash_train.overrides import allowed_values, field_types, sections


def printed_config(capsys, *argv: str) -> dict:
    assert cli.main([*argv, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def sample_value(key: str) -> str:
    """A valid value of the field's type that differs from the default (so a lost alias shows)."""
    section, name = key.split(".")
    tp = field_types(sections()[section])[name]
    choices = allowed_values(tp)
    if choices:
        return next(c for c in choices if c != getattr(getattr(RunConfig(), section), name))
    base = next(a for a in typing.get_args(tp) or (tp,) if a is not type(None))
    if typing.get_origin(base) is tuple:
        return "disk" if typing.get_args(base)[0] is str else "1,2"
    return {bool: "true", int: "3", float: "0.5", str: "some/value"}[base]


ALIASES = [(name, alias) for name in cli.COMMANDS for alias in cli._command(name).ALIASES]


@pytest.mark.parametrize("name,alias", ALIASES, ids=[f"{n}{a.flag}" for n, a in ALIASES])
def test_every_flag_is_its_config_override(name, alias, capsys):
    if alias.const is not None:
        flag_argv, override_argv = [alias.flag], [f"{alias.key}={alias.const}", *alias.also]
    else:
        value = sample_value(alias.key)
        flag_argv, override_argv = [alias.flag, value], [f"{alias.key}={value}", *alias.also]
    by_flag = printed_config(capsys, name, *flag_argv)
    assert by_flag == printed_config(capsys, name, *override_argv)
    assert by_flag != printed_config(capsys, name)  # the flag changed something


def test_eval_flags_spell_eval_drafter_and_target_model(capsys):
    cfg = printed_config(capsys, "eval", "--drafter", "D", "--target", "T")
    assert cfg["eval"]["drafter"] == "D" and cfg["target"]["model"] == "T"


@pytest.mark.parametrize("name", ["eval", "regenerate", "prepare"])
def test_thinking_is_one_field_parsed_one_way(name, capsys):
    assert printed_config(capsys, name, "--thinking", "on")["data"]["thinking"] is True
    assert printed_config(capsys, name, "--thinking", "off")["data"]["thinking"] is False
    assert printed_config(capsys, name, "data.thinking=none")["data"]["thinking"] is None
    assert cli.main([name, "--thinking", "maybe", "--print-config"]) == 2
    assert "data.thinking='maybe': expected bool | None" in capsys.readouterr().out


def test_overrides_come_after_flags_and_win(capsys):
    cfg = printed_config(capsys, "eval", "eval.num_prompts=5", "--num-prompts", "3", "eval.max_new_tokens=9")
    assert cfg["eval"]["num_prompts"] == 5 and cfg["eval"]["max_new_tokens"] == 9


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_recipe_works_for_every_command(name, capsys):
    tiny = printed_config(capsys, name, "--recipe", "tiny")
    assert tiny["data"]["regen_max_new_tokens"] == 24 and tiny["drafter"]["num_layers"] == 1
    default = printed_config(capsys, name)
    assert default == json.loads((RunConfig() if name != "train" else cli.recipes.get("default")).to_json())
    assert cli.main([name, "--recipe", "nope", "--print-config"]) == 2
    text = capsys.readouterr().out
    assert f"dflash-train {name}: FAILED: unknown recipe 'nope'; available: default, gpu, gpu_long, paper, tiny" in text


def test_usage_errors_end_with_the_verdict_line(capsys):
    assert cli.main(["eval", "--bogus-flag"]) == 2
    assert "dflash-train eval: FAILED: unrecognized arguments: --bogus-flag" in capsys.readouterr().out
    assert cli.main(["train", "bogus.key=1"]) == 2
    assert "dflash-train train: FAILED: unknown config section 'bogus'" in capsys.readouterr().out
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().out


def test_help_shows_the_sections_and_the_fields_with_their_docs(capsys):
    assert cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    for section in sections():
        assert f"\n  {section} " in top
    assert "seqs_per_step" in top and "regenerate" in top
    assert cli.main(["eval", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--drafter DRAFTER     = eval.drafter=..." in text
    assert "eval.drafter = None  [str | None]" in text and "z-lab drafter directory the `eval` command" in text
    assert "train.seqs_per_step" not in text  # eval lists what eval reads
    assert cli.main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "topology.mode = 'colocated'  [one of colocated|disaggregated|offline]" in text
    assert "Global batch in sequences per optimizer step" in text


def test_train_validates_before_loading_anything(monkeypatch, capsys):
    """The issue-15 layout, as rank 0 of 8 sees it: fails in validation (the loop is never imported)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delitem(sys.modules, "dflash_train.train.loop", raising=False)
    rc = cli.main(["train", "--recipe", "tiny", "topology.mode=disaggregated", "topology.target_ranks=5"])
    assert rc == 2
    assert capsys.readouterr().out.strip().endswith(
        "dflash-train train: FAILED on rank 0: train.seqs_per_step=4 is not a multiple of train.micro_batch (1) x "
        "drafter ranks (3) = 3: use train.seqs_per_step=3 or 6")
    assert "dflash_train.train.loop" not in sys.modules
    rc = cli.main(["train", "--recipe", "tiny", "topology.mode=disaggregated", "topology.target_ranks=8"])
    assert rc == 2 and "use topology.target_ranks=1..7" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# The verdict handler, on a stand-in command (the real commands are run in tests/*/test_*command*)


@pytest.fixture
def fake_command(monkeypatch):
    calls = []
    module = types.ModuleType("dflash_train.commands.fake")
    module.__doc__ = "A stand-in command."
    module.HELP, module.RECIPE, module.READS = "stand-in", None, ("train",)
    module.ALIASES = (Alias("--steps", "train.max_steps"),)
    module.validate = lambda cfg: calls.append("validate")
    module.outcome = "did it"

    def run(cfg):
        calls.append(("run", cfg.train.max_steps))
        if isinstance(module.outcome, Exception):
            raise module.outcome
        return module.outcome

    module.run = run
    monkeypatch.setitem(sys.modules, "dflash_train.commands.fake", module)
    monkeypatch.setitem(cli.COMMANDS, "fake", "dflash_train.commands.fake")
    return module, calls


def test_verdicts_and_exit_codes(fake_command, capsys):
    module, calls = fake_command
    assert cli.main(["fake", "--steps", "7"]) == 0
    assert capsys.readouterr().out == "dflash-train fake: OK did it\n" and calls == ["validate", ("run", 7)]
    module.outcome = Verdict("(stopped by SIGTERM)", "INTERRUPTED", 3)
    assert cli.main(["fake"]) == 3
    assert capsys.readouterr().out == "dflash-train fake: INTERRUPTED (stopped by SIGTERM)\n"
    module.outcome = ValueError("data.jsonl:3: bad JSON")
    assert cli.main(["fake"]) == 1
    out, err = capsys.readouterr()
    assert out == "dflash-train fake: FAILED: data.jsonl:3: bad JSON\n" and "Traceback" not in err
    from dflash_train.train.state.checkpoint import CheckpointWriteError

    module.outcome = CheckpointWriteError("checkpoint c/step_00000002 not written ([Errno 28] No space left on device)")
    assert cli.main(["fake"]) == 1
    out, err = capsys.readouterr()  # written for users: the message alone, no traceback
    assert out.startswith("dflash-train fake: FAILED: checkpoint c/step_00000002 not written") and not err
    module.outcome = RuntimeError("kernel exploded")
    assert cli.main(["fake"]) == 1
    out, err = capsys.readouterr()
    assert out == "dflash-train fake: FAILED: RuntimeError: kernel exploded\n" and "Traceback" in err


def test_a_failed_validation_never_runs_the_command(fake_command, capsys):
    module, calls = fake_command

    def refuse(cfg):
        raise ConfigError("train.max_steps=7: no")

    module.validate = refuse
    assert cli.main(["fake", "--steps", "7"]) == 2
    assert capsys.readouterr().out == "dflash-train fake: FAILED: train.max_steps=7: no\n" and calls == []
