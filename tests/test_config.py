import pytest

from dflash_train.config import ConfigError, RunConfig, derived_gamma
from dflash_train.overrides import apply_overrides, field_docs, from_dict


def test_overrides_parse_by_type():
    cfg = apply_overrides(RunConfig(), ["train.max_steps=5", "optim.lr=1e-3", "drafter.sliding_window=None",
                                        "target.layer_ids=1,4,7", "train.resume=true"])
    assert cfg.train.max_steps == 5 and cfg.optim.lr == 1e-3
    assert cfg.target.layer_ids == (1, 4, 7) and cfg.train.resume is True
    assert RunConfig().train.max_steps is None  # the default tree is untouched


def test_unknown_keys_are_errors_naming_valid_ones():
    with pytest.raises(ValueError, match="valid keys in train"):
        apply_overrides(RunConfig(), ["train.max_stepz=5"])
    with pytest.raises(ValueError, match="unknown config section"):
        apply_overrides(RunConfig(), ["trian.max_steps=5"])
    with pytest.raises(ConfigError, match="expected int"):
        apply_overrides(RunConfig(), ["train.max_steps=five"])


def test_enumerated_fields_reject_other_values_when_parsed():
    assert apply_overrides(RunConfig(), ["topology.mode=offline"]).topology.mode == "offline"
    with pytest.raises(ConfigError, match="topology.mode='ofline': expected one of colocated, disaggregated, offline"):
        apply_overrides(RunConfig(), ["topology.mode=ofline"])
    with pytest.raises(ConfigError, match="expected bool"):
        apply_overrides(RunConfig(), ["data.thinking=maybe"])
    cfg = apply_overrides(RunConfig(), ["data.thinking=on", "doctor.stages=disk, p2p", "eval.block_size=null"])
    assert cfg.data.thinking is True and cfg.doctor.stages == ("disk", "p2p") and cfg.eval.block_size is None


def test_round_trip_through_dict():
    cfg = apply_overrides(RunConfig(), ["target.layer_ids=1,2", "optim.betas=0.9,0.99"])
    assert from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown config keys"):
        from_dict({"train": {"bogus": 1}})
    older = cfg.to_dict()
    del older["doctor"], older["data"]["regen_out"]  # a config.json written before these existed
    assert from_dict(older) == cfg


def test_field_docs_are_the_docstrings_under_the_fields():
    docs = field_docs()
    assert docs["train.seqs_per_step"].startswith("Global batch in sequences per optimizer step")
    assert docs["eval.drafter"].startswith("z-lab drafter directory")
    assert "train.log_every" not in docs  # no docstring written under it


def test_gamma_follows_the_paper():
    assert derived_gamma(16, None) == 7.0 and derived_gamma(10, None) == 5.0 and derived_gamma(8, None) == 4.0
    assert derived_gamma(16, 3.0) == 3.0


def test_cli_takes_overrides_before_and_after_flags(capsys):
    import json

    from dflash_train.cli import main

    assert main(["train", "train.max_steps=7", "--print-config", "optim.lr=0.002"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["max_steps"] == 7 and printed["optim"]["lr"] == 0.002
    assert main(["train", "--print-config", "bogus.key=1"]) == 2  # unknown keys are still errors
