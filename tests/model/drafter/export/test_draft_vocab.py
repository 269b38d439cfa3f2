"""A draft vocabulary in the form vLLM serves (model/drafter/export/draft_vocab.py): an export writes
`draft_vocab_size`, the target's lm_head rows and d2t (target id = draft id + d2t[draft id], vLLM's
qwen3_dflash.py compute_logits), `check` verifies them as vLLM reads them, and our readers take them, RedHat's
speculators checkpoints' and older exports' draft_vocab.json as the eval's draft vocabulary. Real parts: the tiny
random Qwen3 target saved as an HF directory (SmolLM2's tokenizer, its 49,152-token vocabulary)."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.export.check import check_drafter
from dflash_train.model.drafter.export.draft_vocab import DRAFT_VOCAB, read_draft_vocab
from dflash_train.model.drafter.export.ecosystem import UnsupportedDrafter, load_drafter
from dflash_train.model.drafter.export.export import export_drafter
from dflash_train.model.drafter.export.hf_format import load_zlab, save_speculators
from dflash_train.model.drafter.export.serve import engine_notes
from dflash_train.model.drafter.heads.architectures import build_drafter
from dflash_train.model.target.identity import describe_target
from tests.model.drafter.export.test_ecosystem import assert_same_drafter, f32_drafter, logits, write_speculators
from tests.model.drafter.export.test_serving_check import tiny_drafter
from tests.model.drafter.heads.test_dflash2 import V

IDS = torch.tensor([0, 3, 7, 49, 1000, 4096, 49151])  # the drafter's training softmax (loss.train_vocab)


@pytest.fixture(scope="module")
def target(tiny_qwen3_dir):
    return describe_target(str(tiny_qwen3_dir))


@pytest.fixture(scope="module")
def reduced_export(tiny_qwen3_target, tiny_qwen3_dir, tmp_path_factory):
    drafter = tiny_drafter(tiny_qwen3_target.config)
    out = export_drafter(drafter, tmp_path_factory.mktemp("reduced") / "drafter", str(tiny_qwen3_dir),
                         draft_vocab=IDS, log=lambda m: None)
    return drafter, out


def test_an_export_writes_the_draft_vocabulary_as_vllm_reads_it(reduced_export, tiny_qwen3_target, target):
    drafter, out = reduced_export
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == len(IDS) and config["vocab_size"] == 49152  # logits scattered back to it
    assert not (out / DRAFT_VOCAB).exists()  # one record of it, the one vLLM reads
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64
    assert (torch.arange(len(IDS)) + tensors["d2t"]).tolist() == IDS.tolist()  # each draft id -> its token
    target_rows = tiny_qwen3_target.lm_head_weight[IDS].to(torch.bfloat16)  # the export's dtype
    assert torch.equal(tensors["lm_head.weight"], target_rows)
    vocab = read_draft_vocab(out, 49152)
    assert vocab.served and torch.equal(vocab.ids, IDS) and torch.equal(vocab.rows, target_rows)
    assert load_zlab(out).config == drafter.config  # lm_head and d2t are not the drafter's own weights
    assert check_drafter(out, target) == []
    assert any("drafted over these 7 tokens by vLLM" in note and "by SGLang (it skips them)" in note
               for note in engine_notes(out))


def _broken(reduced_export, tmp_path, change):
    out = tmp_path / "bad"
    shutil.copytree(reduced_export[1], out)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    change(config, tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _map_draft_id_1_to_token_0(config, tensors):
    tensors["d2t"][1] = -1


def _map_the_last_draft_id_outside(config, tensors):
    tensors["d2t"][-1] += 1


def _another_row(config, tensors):
    tensors["lm_head.weight"][2] = tensors["lm_head.weight"][3]


def _no_draft_vocab_size(config, tensors):
    del config["draft_vocab_size"]


@pytest.mark.parametrize("change,field,words", [
    (_map_draft_id_1_to_token_0, "d2t", "draft ids [0, 1] all map to token 0"),
    (_map_the_last_draft_id_outside, "d2t", "outside the vocabulary [0, 49152)"),
    (_another_row, "lm_head.weight", "1 of its 7 rows are not the target's rows"),
    (_no_draft_vocab_size, "draft_vocab_size", "vLLM reads it from draft_vocab_size only and would use 'vocab_size"),
])
def test_a_reduced_vocabulary_vllm_would_serve_wrong_fails_by_field(reduced_export, target, tmp_path, change, field,
                                                                    words):
    failures = check_drafter(_broken(reduced_export, tmp_path, change), target)
    assert [f.field for f in failures] == [field] and words in failures[0].message, failures


def test_a_reduced_dspark_export_fails_naming_the_engine_that_refuses_it(tiny_qwen3_target, tiny_qwen3_dir, target,
                                                                        tmp_path):
    """DSpark's own rule (its head file): SGLang builds markov_w2 with vocab_size rows, so DSpark exports keep
    the whole vocabulary, the draft vocabulary beside in draft_vocab.json; a reduced one fails the check."""
    cfg = drafter_config_from_target(tiny_qwen3_target.config, num_layers=1, block_size=4, mask_token_id=3,
                                     num_taps=2, arch="dspark")
    drafter = build_drafter(dataclasses.replace(cfg, markov_rank=8))
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    said = []
    out = export_drafter(drafter, tmp_path / "dspark", str(tiny_qwen3_dir), draft_vocab=IDS, log=said.append)
    assert torch.equal(read_draft_vocab(out, 49152).ids, IDS) and not read_draft_vocab(out, 49152).served
    assert "draft_vocab_size" not in json.loads((out / "config.json").read_text())
    assert any(f"stays in {DRAFT_VOCAB}" in line and "SGLang builds markov_w2" in line for line in said)
    config = json.loads((out / "config.json").read_text())
    config["draft_vocab_size"] = len(IDS)
    (out / "config.json").write_text(json.dumps(config))
    failures = check_drafter(out, target)
    assert [f.field for f in failures] == ["draft_vocab_size"] and "SGLang builds markov_w2" in failures[0].message


def _reduce(out, ids: torch.Tensor, lm_head: torch.Tensor, rows_per_draft_token=()):
    """Make a speculators checkpoint reduced as speculators saves one: lm_head at the draft tokens, d2t, the t2d
    mask, the frozen embedding, and the tensors with a row per draft token (vLLM's DSpark markov_w2) cut."""
    tensors = load_file(str(out / "model.safetensors"))
    for name in rows_per_draft_token:
        tensors[name] = tensors[name][ids].contiguous()
    tensors.update({"lm_head.weight": lm_head[ids].contiguous(), "d2t": ids - torch.arange(len(ids)),
                    "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True),
                    "embed_tokens.weight": torch.randn(V, lm_head.shape[1])})
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("arch", ["dflash", "dspark"])
def test_a_speculators_checkpoint_with_a_reduced_vocabulary_reads_as_vllm_serves_it(arch, tmp_path):
    """RedHat's reduced speculators checkpoints (a 32000-row lm_head and d2t): the drafter loads as trained, and
    its draft vocabulary is its d2t's tokens scored with its own lm_head rows; DSpark's markov_w2, one row per draft
    token as vLLM builds it, is ours at those tokens (logits there equal)."""
    drafter = f32_drafter(arch)
    ids, lm_head = torch.tensor([1, 5, 20, 60, 95]), torch.randn(V, drafter.config.hidden_size)
    markov = ("markov_head.markov_w2.weight",) if arch == "dspark" else ()
    out = _reduce(write_speculators(drafter, tmp_path / "spec", draft_vocab_size=len(ids)), ids, lm_head, markov)
    loaded = load_drafter(out, num_target_layers=8).drafter
    if arch == "dflash":
        assert_same_drafter(loaded, drafter)
    else:  # the draft tokens' logits are the drafter's; the others are never drafted (-inf)
        torch.testing.assert_close(logits(loaded.double())[0][:, ids], logits(drafter)[0][:, ids])
    vocab = read_draft_vocab(out, V)
    assert vocab.served and torch.equal(vocab.ids, ids) and torch.equal(vocab.rows, lm_head[ids])


def test_a_reduced_vocabulary_no_engine_serves_as_trained_is_refused_by_file_and_key(tmp_path):
    out = write_speculators(f32_drafter("dflash2"), tmp_path / "spec", draft_vocab_size=5)
    with pytest.raises(UnsupportedDrafter, match=rf"{out / 'config.json'}: draft_vocab_size: .*vLLM's DFlash 2"):
        load_drafter(out, num_target_layers=8)
    out = write_speculators(f32_drafter("dflash"), tmp_path / "spec1", draft_vocab_size=5)  # no d2t to read it by
    with pytest.raises(ValueError, match=rf"{out / 'config.json'}: draft_vocab_size 5 of {V} tokens, but no "):
        load_drafter(out, num_target_layers=8)


def test_our_speculators_export_writes_the_reduced_vocabulary_as_speculators_does(tmp_path):
    """`dflash-train export --format speculators` of a drafter with a draft vocabulary: speculators' reduced
    layout (lm_head rows in token order as its t2d mask selects them, d2t, t2d, draft_vocab_size), read back."""
    drafter = f32_drafter("dflash")
    lm_head = torch.randn(V, drafter.config.hidden_size)
    out = save_speculators(drafter, tmp_path / "spec", torch.randn(V, drafter.config.hidden_size), lm_head, "v",
                           ["Qwen3ForCausalLM"], dtype=torch.float32, draft_vocab=torch.tensor([95, 1, 20]))
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 3
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["t2d"].nonzero().flatten().tolist() == [1, 20, 95]
    assert torch.equal(tensors["lm_head.weight"], lm_head[[1, 20, 95]])
    assert read_draft_vocab(out, V).ids.tolist() == [1, 20, 95]
    assert_same_drafter(load_drafter(out, num_target_layers=8).drafter, drafter)
