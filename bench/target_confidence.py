"""How sure the target itself is of what it writes, per prompt set: does the target limit tau, or the drafter's data?

For each prompt set (the eval's names: `assistant`, `chitchat`, `humaneval`, a JSONL path, ...) the target decodes
greedily from each prompt through the eval's own plain decode (its chat rendering and stopping rule), then one forward
over prompt + answer reads its own top-1 probability at every new token. A drafter
only has to match that argmax, but where the target itself hesitates the choice rests on details a small drafter
rarely learns, so a set the target writes with low confidence caps tau for any drafter. Given a run's
`eval/report.json` (`--report`), each set's real tau and first-slot acceptance are printed beside its confidence.

    python bench/target_confidence.py --sets assistant,chitchat,humaneval --report runs/gpu/eval/report.json
    python bench/target_confidence.py --small      # 2 prompts, 8 tokens (seconds; the test)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as C  # noqa: E402
from dflash_train.eval.evaluate import encode_prompts, eos_token_ids  # noqa: E402
from dflash_train.eval.prompt_sets import load_prompt_sets  # noqa: E402
from dflash_train.eval.spec_decode import target_generate  # noqa: E402
from dflash_train.model.target.load import load_target  # noqa: E402

LOW, HIGH = 0.5, 0.95  # top-1 probability bands reported


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_target_set_args(p, "2 prompts of one set, 8 new tokens")
    p.add_argument("--num-prompts", type=int, default=24, help="prompts per set (the eval's default recipe: 24)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (the eval's max_new_tokens)")
    p.add_argument("--report", help="a run's eval/report.json: its tau per set printed beside")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


@torch.no_grad()
def top1_probabilities(target, prompt_ids: torch.Tensor, new_tokens: int, eos: set[int]) -> tuple[list[float], int]:
    """The target's top-1 probability at each token of its greedy answer to `prompt_ids` [1, P], and how many of
    those tokens the one forward's argmax agrees with: the eval's own plain decode (`target_generate`, its
    stopping rule), then one forward over prompt + answer (the agreement checks that it read the right rows)."""
    answer = target_generate(target.model, prompt_ids, new_tokens, eos).tokens
    if not answer:
        return [], 0
    ids = torch.cat([prompt_ids, torch.tensor([answer], device=prompt_ids.device)], dim=1)  # [1, P + A]
    probs = target.model(ids).logits[0, prompt_ids.shape[1] - 1:-1].float().softmax(-1)  # [A, V]: each token's choice
    top1, choice = probs.max(-1)
    return top1.tolist(), int((choice.cpu() == torch.tensor(answer)).sum())


def figures(probabilities: list[float]) -> dict:
    p = torch.tensor(probabilities)
    return {"tokens": len(p), "mean_top1": p.mean().item(), f"share_below_{LOW}": (p < LOW).float().mean().item(),
            f"share_at_least_{HIGH}": (p >= HIGH).float().mean().item()}


def main(argv=None) -> int:
    a = parse(argv)
    b, device = C.start("target_confidence", a)
    sets_spec, num, new = ("chitchat", 2, 8) if a.small else (a.sets, a.num_prompts, a.new_tokens)
    report = json.loads(Path(a.report).read_text())["sets"] if a.report else {}
    rows = {}
    with b.phase("target and prompt sets"):
        target = load_target(a.target, device=device)
        sets = load_prompt_sets(sets_spec, num)
    if not b.ok("target and prompt sets"):
        return b.finish("no target or prompt sets", a.json)
    for name, prompts in sets.items():
        with b.phase(f"greedy answers of {name}"):
            eos = eos_token_ids(target.tokenizer, target.model)
            encoded = encode_prompts(target.tokenizer, prompts, None, target.device)  # as the eval renders them
            answers = [top1_probabilities(target, ids, new, eos) for ids in encoded]
            probabilities = [q for top1, _ in answers for q in top1]
            rows[name] = figures(probabilities)
            b.figure(f"{name}_argmax_agrees", sum(agree for _, agree in answers) / max(1, len(probabilities)),
                     "share of answer tokens the re-read forward also picks (1.0 in float32; near-ties in bf16)")
            b.figure(f"{name}_mean_top1", rows[name]["mean_top1"], f"{rows[name]['tokens']} tokens")
            b.figure(f"{name}_share_below_{LOW}".replace(".", ""), rows[name][f"share_below_{LOW}"])
    C.say(f"{'set':<16} {'tokens':>6} {'mean top-1':>10} {f'p<{LOW}':>7} {f'p>={HIGH}':>8} {'tau':>6} {'slot 0':>7}")
    for name, row in rows.items():
        real = report.get(name, {})
        tau = f"{real['tau']:.3f}" if "tau" in real else "-"
        slot0 = f"{real['per_position_acceptance'][0]:.2f}" if real.get("per_position_acceptance") else "-"
        C.say(f"{name:<16} {row['tokens']:>6} {row['mean_top1']:>10.3f} {row[f'share_below_{LOW}']:>7.3f} "
              f"{row[f'share_at_least_{HIGH}']:>8.3f} {tau:>6} {slot0:>7}")
    verdict = ", ".join(f"{name} {row['mean_top1']:.3f}" for name, row in rows.items())
    return b.finish(f"the target's mean top-1 probability on its own greedy answers: {verdict}", a.json)


if __name__ == "__main__":
    sys.exit(main())
