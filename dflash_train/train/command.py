"""What `dflash-train train` prints at the end of a run (dflash_train/commands/train.py): the
summary and the commands that serve the exported drafter with the target it was trained against."""

from __future__ import annotations

from dflash_train.model.drafter.export.serve import serve_instructions


def summary(result: dict) -> str:
    sim = result.get("sim") or {}
    lines = [f"trained {result['steps']}/{result['total_steps']} steps, {result['tokens']} tokens; "
             f"held-out simulated tau {sim.get('sim_tau', float('nan')):.3f}"]
    for name, rep in (result.get("eval") or {}).items():
        lines.append(f"real speculative decoding [{name}]: tau {rep['tau']:.3f}, speedup {rep['speedup']:.2f}x "
                     f"({rep.get('num_prompts', '?')} prompts)")
    lines.append(f"checkpoint: {result.get('checkpoint')}\ndrafter (z-lab format): {result.get('export')}")
    if result.get("report"):
        lines.append(f"report: {result['report']}")
    lines.append(serve_instructions(result["export"]))  # the recorded training target, block_size - 1 tokens
    return "\n".join(lines)
