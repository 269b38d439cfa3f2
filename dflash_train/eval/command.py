"""Prompt sets of the `eval` command (dflash_train/commands/eval.py): the held-out defaults or a
JSONL file of conversations."""

from __future__ import annotations


def load_prompt_sets(prompts: str | None, num_prompts: int) -> dict[str, list[list[dict]]]:
    """The default held-out sets, or one set named after the JSONL file; first `num_prompts` of each."""
    if prompts is None:
        from dflash_train.data.corpus import default_eval_prompts

        sets = default_eval_prompts()
    else:
        from pathlib import Path

        from dflash_train.data.conversations import read_conversations

        convs, _ = read_conversations(prompts)
        sets = {Path(prompts).stem: [c.messages for c in convs]}
    return {name: msgs[:num_prompts] for name, msgs in sets.items()}
