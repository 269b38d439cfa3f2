"""Base models (no chat template): `data.format=auto` (the default) trains them on plain-text
continuations, the chat format refuses such a target right after its tokenizer loads, naming the
option, and the end-of-run eval decodes text prefixes."""

from __future__ import annotations

import copy
import json
import signal

import pytest
import torch

from dflash_train import cli, recipes
from dflash_train.config import DataConfig
from dflash_train.overrides import apply_overrides
from dflash_train.data.rows import DataError
from dflash_train.data.text import continuation_samples, read_documents, resolve_data_format, split_point
from dflash_train.train.loop import train
from tests.conftest import save_tiny_qwen3_dir

DOCUMENTS = [
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps aloud so the silence "
    "would not settle in. At the top he trimmed the wick and watched the beam sweep across the water.",
    "Bread rises because yeast eats sugar and breathes out carbon dioxide. The gluten in the dough traps the "
    "gas in small pockets, and the heat of the oven sets the walls of those pockets into a soft crumb.",
    "In the spring the river floods the low fields, leaving a layer of silt that farmers have relied on for "
    "centuries. The water recedes slowly, and by early summer the ground is dark and ready for planting.",
    "A good map leaves things out. It shows the roads you need and hides the ones you do not, so that the "
    "reader sees the shape of the journey rather than every turn along the way.",
    "The orchestra tuned to a single note from the oboe, a sound thin enough to cut through the murmur of "
    "the hall. One by one the sections settled, and then the conductor raised both hands.",
    "Glaciers move by sliding on a film of meltwater and by slowly deforming under their own weight. Over "
    "thousands of years they carve valleys into a wide U shape and leave boulders far from their source.",
]


@pytest.fixture(autouse=True)
def contained(monkeypatch, tmp_path):
    """train() installs SIGTERM/SIGINT handlers and points inductor's cache at the run's parent."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def base_model_dir(smollm2_tokenizer, tmp_path_factory):
    """The tiny Qwen3 saved with the SmolLM2 tokenizer minus its chat template: a base model."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = None
    return save_tiny_qwen3_dir(tmp_path_factory.mktemp("base_model"), tokenizer)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": f"doc{i}", "text": t}) + "\n" for i, t in enumerate(DOCUMENTS)))
    return path


def _config(model_dir, docs, out, *extra):
    return apply_overrides(recipes.get("tiny"), [
        f"target.model={model_dir}", f"data.train={docs}", f"train.out_dir={out}", "target.dtype=float32",
        "data.text_prompt_tokens=12", "data.regen_max_new_tokens=10", "data.eval_fraction=0.34",
        "train.max_steps=2", "train.seqs_per_step=2", "train.compile=off", "train.attention=sdpa",
        "eval.num_prompts=0", "drafter.num_taps=3", *extra])  # 6 target layers: 3 distinct taps


def test_split_point_and_document_reading(tmp_path):
    assert [split_point(n, 12) for n in (2, 5, 24, 100)] == [1, 2, 12, 12]
    txt = tmp_path / "book.txt"
    txt.write_text("First paragraph.\nStill the first.\n\n\nSecond one.\n  \nThird.\n")
    docs, bad = read_documents(str(txt))
    assert [d.text for d in docs] == ["First paragraph.\nStill the first.", "Second one.", "Third."]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "plain"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                    + "\n" + json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(DataError, match="rows.jsonl:3: field 'text': missing"):
        read_documents(str(rows))
    docs, bad = read_documents(str(rows), skip_bad_rows=True)
    assert [d.text for d in docs] == ["plain", "q\n\na"] and [d.id[:3] for d in docs] == ["L1-", "L2-"]
    assert bad.counts == {"missing_field": 1}


def test_auto_format_follows_the_chat_template_and_chat_needs_one(smollm2_tokenizer):
    base = copy.deepcopy(smollm2_tokenizer)
    base.chat_template = None
    assert resolve_data_format("auto", smollm2_tokenizer, "t")[0] == "chat"
    fmt, why = resolve_data_format("auto", base, "t")
    assert fmt == "text" and "no chat template" in why
    assert resolve_data_format("text", smollm2_tokenizer, "t")[0] == "text"
    assert resolve_data_format("chat", smollm2_tokenizer, "t")[0] == "chat"
    with pytest.raises(ValueError, match="no chat template.*set data.format=text"):
        resolve_data_format("chat", base, "t")
    with pytest.raises(ValueError, match="data.format='prose'"):
        resolve_data_format("prose", smollm2_tokenizer, "t")


def test_continuations_are_the_targets_greedy_ones_with_loss_on_them_only(tiny_qwen3_target, documents):
    """Against a naive greedy loop of full forwards (no cache, no batching, no padding)."""
    cfg = DataConfig(train=str(documents), format="text", text_prompt_tokens=12, regen_max_new_tokens=6,
                     regen_batch_size=4, max_len=64)
    samples = continuation_samples(cfg, tiny_qwen3_target, seed=0, log=lambda m: None)
    assert [s.id for s in samples] == [f"doc{i}" for i in range(len(DOCUMENTS))]
    tok = tiny_qwen3_target.tokenizer
    for sample, text in zip(samples, DOCUMENTS):
        prompt = tok(text)["input_ids"][:12]
        assert sample.input_ids[:12] == prompt and sample.loss_mask == [0] * 12 + [1] * (len(sample.input_ids) - 12)
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(tiny_qwen3_target.model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert sample.input_ids == ids[:len(sample.input_ids)] and len(sample.input_ids) == 18
    kept = continuation_samples(DataConfig(train=str(documents), format="text", text_prompt_tokens=12,
                                           regenerate=False, max_len=20), tiny_qwen3_target, 0, lambda m: None)
    assert kept[0].input_ids == tok(DOCUMENTS[0])["input_ids"][:20] and sum(kept[0].loss_mask) == 8


@pytest.mark.parametrize("regenerate, loss", [("true", "ce"), ("false", "ce"), ("true", "kl")])
def test_a_base_model_trains_on_text_continuations(base_model_dir, documents, tmp_path, regenerate, loss):
    """regenerate=true takes the taps kept while the target writes the continuations; false tokenizes
    the documents' own continuations and taps them every step. A distillation loss (kl) also keeps the
    target's final hidden states of the regeneration pass."""
    out = tmp_path / "run"
    result = train(_config(base_model_dir, documents, out, f"data.regenerate={regenerate}", f"loss.kind={loss}"))
    assert result["steps"] == 2 and (out / "drafter" / "config.json").is_file()
    if regenerate == "true":
        assert len(list((out / "data").glob(f"tapped-*{'-final' if loss == 'kl' else ''}.safetensors"))) == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)


def test_chat_format_on_a_base_model_fails_before_the_weights_load(base_model_dir, documents, tmp_path, capsys):
    with pytest.raises(ValueError, match="no chat template.*set data.format=text"):
        train(_config(base_model_dir, documents, tmp_path / "run", "data.format=chat"))
    printed = capsys.readouterr().out
    assert "target: loading" in printed and "target: loaded" not in printed


def test_chat_prompt_sets_on_a_base_model_fail_before_the_weights_load(base_model_dir, documents, tmp_path):
    with pytest.raises(ValueError, match="chitchat render chat prompts.*no chat template.*heldout, prose"):
        train(_config(base_model_dir, documents, tmp_path / "run", "eval.num_prompts=2", "eval.prompts=chitchat"))


@pytest.fixture(scope="module")
def gemma3_base_dir(smollm2_tokenizer, tmp_path_factory):
    """A seeded random text-only Gemma 3 (embeddings scaled by sqrt(hidden_size)) saved with the SmolLM2
    tokenizer minus its chat template: a base model of a family that scales its embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = None
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), sliding_window=16,
                           max_position_embeddings=4096, initializer_range=0.2)
    model = Gemma3ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out = tmp_path_factory.mktemp("gemma3_base")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_a_base_gemma3_trains_exports_checks_and_evaluates_on_text(gemma3_base_dir, documents, tmp_path, capsys):
    """No option but the target: text continuation is picked from the tokenizer (one line), the drafter
    trains with the target's embedding scale and exports it, the export passes the serving check against
    the target directory, and the end-of-run eval decodes held-out and embedded text prefixes, lossless
    (float32) with a real tau per set."""
    from dflash_train.model.drafter.export.check import check_drafter
    from dflash_train.model.target.identity import describe_target

    out = tmp_path / "run"
    result = train(_config(gemma3_base_dir, documents, out, "eval.num_prompts=2", "eval.dtype=target"))
    printed = capsys.readouterr().out
    assert "data: plain-text continuations (data.format=text: the tokenizer has no chat template" in printed
    exported = json.loads((out / "drafter" / "config.json").read_text())["dflash_config"]
    assert exported["input_embedding_scale"] == 8.0  # sqrt(64)
    assert "output_multiplier" not in exported and "final_logit_softcapping" not in exported
    assert check_drafter(out / "drafter", describe_target(str(gemma3_base_dir))) == []
    assert set(result["eval"]) == {"heldout", "prose"}
    for figures in result["eval"].values():
        assert figures["num_prompts"] >= 1 and figures["identical_outputs"] == figures["num_prompts"]
        assert 1.0 <= figures["tau"] <= 4.0 and figures["steps"] > 0
    assert "eval [prose]: tau" in printed
    # the eval command picks the text sets for this target by itself too
    assert cli.main(["eval", "--drafter", str(out / "drafter"), "--target", str(gemma3_base_dir), "--num-prompts", "1",
                     "--max-new-tokens", "8", "--out", str(tmp_path / "eval"), "--no-progress", "--dtype", "float32", "eval.dtype=target",
                     "--prompts", "prose"]) == 0
    printed = capsys.readouterr().out
    assert "data.format=text" in printed and json.loads((tmp_path / "eval" / "report.json").read_text())["sets"]["prose"]
