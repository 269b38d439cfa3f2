"""What `dflash-train train` prints at the end of a run (dflash_train/commands/train.py): the
summary and the commands that serve the exported drafter."""

from __future__ import annotations

from pathlib import Path


def serving_commands(drafter_dir: str, target: str, block_size: int) -> str:
    spec = ('{"method": "dflash", "model": "%s", "num_speculative_tokens": %d}' % (drafter_dir, block_size - 1))
    return (f"  vLLM:   vllm serve {target} --speculative-config '{spec}' --attention-backend flash_attn\n"
            f"  SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {drafter_dir} --speculative-num-draft-tokens {block_size}")


def served_target(target_cfg) -> str:
    """What a serving engine should load as the target: the hub id of the embedded SmolLM2, the
    HF directory this tool converted a GGUF file into (safetensors + tokenizer, which vLLM and
    SGLang load as is), or the model path as given."""
    if target_cfg.model == "smollm2":
        return "HuggingFaceTB/SmolLM2-135M-Instruct"
    from dflash_train.model.target import gguf_cache_dir, resolve_target

    path, gguf_file = resolve_target(target_cfg.model, target_cfg.gguf_file)
    if gguf_file is not None and gguf_cache_dir(Path(path) / gguf_file).is_dir():
        return str(gguf_cache_dir(Path(path) / gguf_file))
    return target_cfg.model


def summary(cfg, result: dict) -> str:
    sim = result.get("sim") or {}
    lines = [f"trained {result['steps']}/{result['total_steps']} steps, {result['tokens']} tokens; "
             f"held-out simulated tau {sim.get('sim_tau', float('nan')):.3f}"]
    for name, rep in (result.get("eval") or {}).items():
        lines.append(f"real speculative decoding [{name}]: tau {rep['tau']:.3f}, speedup {rep['speedup']:.2f}x "
                     f"({rep.get('num_prompts', '?')} prompts)")
    lines.append(f"checkpoint: {result.get('checkpoint')}\ndrafter (z-lab format): {result.get('export')}")
    if result.get("report"):
        lines.append(f"report: {result['report']}")
    lines.append("serve it with:\n" + serving_commands(result.get("export", "DRAFTER_DIR"), served_target(cfg.target),
                                                         cfg.drafter.block_size))
    return "\n".join(lines)
