"""`dflash-train train` end to end, colocated on one GPU: steady tokens/s and peak memory.

    python bench/train_e2e.py                                   # random Qwen3-8B-shaped target, paper recipe
    python bench/train_e2e.py --precision fp8 --target-precision fp8   # float8 drafter and target
    python bench/train_e2e.py --small --steps 4                 # tiny shapes, CPU (minutes)

A random target of the given shape is made on the device (meta device + to_empty + normal init,
seconds) with a byte-level tokenizer and a Qwen-style chat template, saved once as an HF directory
(`--target-dir`, reused while its shape matches), then `dflash-train train --recipe paper` runs in
this process on synthetic long chats (`--chats` of `--chat-tokens`+ tokens, data.regenerate=false,
so the target computes the taps every step as in the issue's measurement) for `--steps` steps.
Figures: steady tokens/s (median of the trainer's logged interval rates after the first, which
holds compilation), step time, peak GPU memory over the training.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import _common as C  # noqa: E402

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def parse(argv=None):
    p = argparse.ArgumentParser(description="dflash-train train end to end on a random target")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (the trainer itself runs on cuda:0 or the CPU)")
    p.add_argument("--layers", type=int, help="target layers (default 36; 8 with --small)")
    p.add_argument("--chats", type=int, help="synthetic chats (default 400; 24 with --small)")
    p.add_argument("--chat-tokens", type=int, help="tokens per chat at least (default 3200; 160 with --small)")
    p.add_argument("--steps", type=int, help="training steps (default 50; 4 with --small)")
    p.add_argument("--log-every", type=int, help="trainer log interval (default 10; 1 with --small)")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="train.precision")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise", help="train.fp8_recipe")
    p.add_argument("--target-precision", choices=("bf16", "fp8"), default="bf16", help="target.precision")
    p.add_argument("--fp8-lm-head", action="store_true", help="train.fp8_lm_head=true (with --precision fp8)")
    p.add_argument("--target-dir", default="/tmp/dflash-e2e-target", help="where the random target is saved")
    p.add_argument("--out", default="/tmp/dflash-e2e-run", help="train.out_dir (emptied first)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more trainer overrides")
    p.add_argument("--json", help="write the figures to this JSON file")
    a = p.parse_args(argv)
    a.layers = a.layers or (8 if a.small else 36)
    a.chats = a.chats or (24 if a.small else 400)
    a.chat_tokens = a.chat_tokens or (160 if a.small else 3200)
    a.steps = a.steps or (4 if a.small else 50)
    a.log_every = a.log_every or (1 if a.small else 10)
    return a


def byte_tokenizer():
    """Byte-level tokenizer (one token per byte, no merges) with Qwen-style chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_target(a, b: C.Bench, device: torch.device) -> Path:
    """The random target's HF directory, made on the device and saved once per shape."""
    out = Path(a.target_dir) / ("small" if a.small else f"qwen3-8b-{a.layers}l")
    cfg = C.target_config(a.small, a.layers)
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()).get(
            "num_hidden_layers") == cfg.num_hidden_layers and any(out.glob("*.safetensors")):
        b.log(f"random target: reusing {out}")
        return out
    tokenizer = byte_tokenizer()
    cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = C.random_target(cfg, device, dtype)
    b.log(f"random target: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params made on {device}; "
          f"saving to {out}")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def make_chats(a, path: Path) -> Path:
    """Two-turn chats of random words, each at least `chat_tokens` bytes (= tokens) long."""
    rng = random.Random(0)

    def text(n_chars: int) -> str:
        words = []
        while sum(len(w) + 1 for w in words) < n_chars:
            words.append(rng.choice(WORDS))
        return " ".join(words)

    with open(path, "w") as f:
        for i in range(a.chats):
            user = text(a.chat_tokens // 8)
            f.write(json.dumps({"id": f"chat{i}", "messages": [{"role": "user", "content": user},
                                                               {"role": "assistant", "content": text(a.chat_tokens)}]})
                    + "\n")
    return path


def train_overrides(a, target_dir: Path, data: Path) -> list[str]:
    over = [f"target.model={target_dir}", f"data.train={data}", "data.regenerate=false", f"train.out_dir={a.out}",
            f"train.max_steps={a.steps}", f"train.log_every={a.log_every}", "train.tensorboard=false",
            f"train.eval_every={10 * a.steps}", f"train.ckpt_every={10 * a.steps}", "eval.num_prompts=0",
            f"train.precision={a.precision}", f"train.fp8_recipe={a.fp8_recipe}", f"train.fp8_lm_head={a.fp8_lm_head}",
            f"target.precision={a.target_precision}"]
    if a.small:
        over += ["data.max_len=128", "drafter.num_layers=1", "drafter.block_size=4", "train.num_anchors=8",
                 "train.seqs_per_step=4"]
    return over + list(a.set)


def main(argv=None) -> int:
    import shutil

    a = parse(argv)
    b, device = C.start("train_e2e", a)
    b.info.update(device=str(device), precision=a.precision, fp8_recipe=a.fp8_recipe,
                  target_precision=a.target_precision, steps=a.steps, chats=a.chats, chat_tokens=a.chat_tokens)
    st: dict = {}
    with b.phase("random target and chats"):
        st["target"] = make_target(a, b, device)
        shutil.rmtree(a.out, ignore_errors=True)
        Path(a.out).mkdir(parents=True)
        st["data"] = make_chats(a, Path(a.out).parent / f"{Path(a.out).name}-chats.jsonl")
    if b.ok("random target and chats"):
        with b.phase("dflash-train train"):
            from dflash_train.cli import main as cli_main

            C.reset_peak_memory(device)
            argv = ["train", "--recipe", "paper"] + train_overrides(a, st["target"], st["data"])
            b.log("running: dflash-train " + " ".join(argv))
            rc = cli_main(argv)
            if device.type == "cuda":
                b.figure("peak_memory_gib", C.peak_memory_gib(device), "max_memory_allocated over the whole run")
            if rc != 0:
                raise RuntimeError(f"dflash-train train exited with {rc}")
        with b.phase("figures"):
            rates = [r["tokens_per_s"] for r in map(json.loads, (Path(a.out) / "metrics.jsonl").read_text().splitlines())
                     if "tokens_per_s" in r]
            steady = rates[1:] or rates
            b.figure("tokens_per_s_intervals", len(rates))
            b.figure("tokens_per_s", C.median(steady), f"median of {len(steady)} logged intervals after the first")
            b.figure("tokens_per_s_first_interval", rates[0], "includes compilation")
    f = b.figures
    parts = [f"drafter {a.precision}" + (f" ({a.fp8_recipe})" if a.precision == "fp8" else "")
             + f", target {a.target_precision}"]
    if "tokens_per_s" in f:
        parts.append(f"steady {C.fmt_rate(f['tokens_per_s'])}")
    if "peak_memory_gib" in f:
        parts.append(f"peak {f['peak_memory_gib']:.1f} GiB")
    return b.finish("; ".join(parts), a.json)


if __name__ == "__main__":
    sys.exit(main())
