import pytest

from dflash_train.config import RunConfig, apply_overrides, derived_gamma, from_dict


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
    with pytest.raises(ValueError, match="expected int"):
        apply_overrides(RunConfig(), ["train.max_steps=five"])


def test_round_trip_through_dict():
    cfg = apply_overrides(RunConfig(), ["target.layer_ids=1,2", "optim.betas=0.9,0.99"])
    assert from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown config keys"):
        from_dict({"train": {"bogus": 1}})


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
