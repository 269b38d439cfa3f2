"""`dflash-train export` never deletes or moves what is at `--out` unless it is an earlier export of
ours (issue 39, defect 2: an existing directory's contents were deleted and the command printed OK,
an existing file was renamed to .old), is written beside and swapped in only once it passes the
serving check, refuses non-finite weights before writing anything (defect 5: a complete-looking
directory holding a NaN was left), and a SIGTERM mid-way leaves nothing and ends with a verdict.
Real parts: the tiny Qwen3 target saved as an HF directory, a tiny drafter for it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train import cli
from dflash_train.model.drafter.export.hf_format import EXPORT_MARKER, load_zlab, save_zlab
from dflash_train.model.drafter.export.export import export_drafter
from tests.model.drafter.export.test_serving_check import tiny_drafter

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def drafter_dir(tiny_qwen3_target, tmp_path_factory):
    """A float32 drafter directory, as a training checkpoint holds it (the export's input)."""
    return save_zlab(tiny_drafter(tiny_qwen3_target.config), tmp_path_factory.mktemp("ckpt") / "drafter",
                     dtype=torch.float32)


def _export(drafter_dir, out, target_dir) -> int:
    return cli.main(["export", "--drafter", str(drafter_dir), "--out", str(out), "--target", str(target_dir)])


def test_an_existing_directory_of_the_users_is_refused_untouched(drafter_dir, tiny_qwen3_dir, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    (mine / "config.json").write_text('{"mine": true}')
    assert _export(drafter_dir, mine, tiny_qwen3_dir) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and str(mine) in out and EXPORT_MARKER in out
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    assert (mine / "notes.txt").read_text() == "my notes" and (mine / "config.json").read_text() == '{"mine": true}'
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing written beside


def test_an_existing_file_is_refused_and_never_renamed(drafter_dir, tiny_qwen3_dir, tmp_path, capsys):
    mine = tmp_path / "mine.bin"
    mine.write_bytes(b"precious")
    assert _export(drafter_dir, mine, tiny_qwen3_dir) == 1
    assert "FAILED" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.bin"] and mine.read_bytes() == b"precious"


def test_an_earlier_export_of_ours_is_replaced_and_an_empty_directory_filled(drafter_dir, tiny_qwen3_dir, tmp_path):
    out = tmp_path / "export"
    out.mkdir()  # empty: nothing to lose
    assert _export(drafter_dir, out, tiny_qwen3_dir) == 0
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["written_by"] == "dflash-train" and "model.safetensors" in marker["files"]
    first = (out / "model.safetensors").stat().st_ino
    assert _export(drafter_dir, out, tiny_qwen3_dir) == 0  # ours, by its marker: replaced
    assert (out / "model.safetensors").stat().st_ino != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .old, no temporary left


def test_a_drafter_holding_a_nan_is_refused_before_anything_is_written(drafter_dir, tiny_qwen3_dir, tmp_path, capsys):
    nan_dir = tmp_path / "nan"
    nan_dir.mkdir()
    (nan_dir / "config.json").write_text((drafter_dir / "config.json").read_text())
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    tensors["layers.0.mlp.up_proj.weight"][1, 2] = float("nan")
    save_file(tensors, str(nan_dir / "model.safetensors"))
    out = tmp_path / "export"
    assert _export(nan_dir, out, tiny_qwen3_dir) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "layers.0.mlp.up_proj.weight" in text and "NaN" in text
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["nan"]
    with pytest.raises(ValueError, match="layers.0.mlp.up_proj.weight"):  # the library call alike
        export_drafter(load_zlab(nan_dir), out, str(tiny_qwen3_dir))
    assert not out.exists()


def test_an_export_that_fails_its_check_leaves_nothing(tiny_qwen3_target, tmp_path):
    from dflash_train.model.drafter.export.check import ServingContractError
    from tests.conftest import tiny_qwen3

    narrow = tiny_qwen3(tiny_qwen3_target.vocab_size, hidden=32)
    narrow.save_pretrained(tmp_path / "narrow")
    with pytest.raises(ServingContractError, match="nothing was written"):
        export_drafter(tiny_drafter(tiny_qwen3_target.config), tmp_path / "d", str(tmp_path / "narrow"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["narrow"]


def test_sigterm_during_an_export_leaves_no_unchecked_directory_and_ends_with_a_verdict(drafter_dir, tiny_qwen3_dir,
                                                                                       tmp_path):
    """SIGTERM as soon as the export's temporary directory appears (retried until one lands mid-way)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    interrupted = 0
    for attempt in range(6):
        parent = tmp_path / f"attempt{attempt}"
        parent.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "dflash_train", "export", "--drafter", str(drafter_dir),
                                 "--out", str(parent / "drafter"), "--target", str(tiny_qwen3_dir)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None and not any(p.name.startswith(".drafter.") for p in parent.iterdir()):
            time.sleep(0.001)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        text = proc.communicate(timeout=120)[0]
        left = sorted(p.name for p in parent.iterdir())
        if "INTERRUPTED" in text:
            interrupted += 1
            assert proc.returncode == 3 and left == [], (left, text[-1500:])
            assert text.strip().splitlines()[-1].startswith("dflash-train export: INTERRUPTED")
        else:  # finished before the signal: a whole, checked export
            assert proc.returncode == 0 and left == ["drafter"] and (parent / "drafter" / EXPORT_MARKER).is_file()
        if interrupted >= 2:
            break
    assert interrupted >= 1
