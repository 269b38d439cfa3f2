"""Builders for the eval tests: tiny random Qwen3 targets, tiny drafters, a bigram target."""

from types import SimpleNamespace

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter


def tiny_qwen3_config(vocab=97, layers=4, hidden=64, **kw) -> Qwen3Config:
    base = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=hidden // 4, vocab_size=vocab, rope_theta=10000.0,
                rms_norm_eps=1e-6, attn_implementation="eager", tie_word_embeddings=False)
    base.update(kw)
    return Qwen3Config(**base)


def tiny_target(seed=0, dtype=torch.float64, **kw) -> Qwen3ForCausalLM:
    """A seeded random Qwen3; float64 so argmax never flips between a 1-token and a B-token forward."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(**kw)).to(dtype).eval()


def tiny_drafter(target_config, seed=0, block_size=4, layers=1, num_taps=2, mask_token_id=None,
                 dtype=torch.float64, std=0.2) -> DFlashDrafter:
    mask = target_config.vocab_size - 1 if mask_token_id is None else mask_token_id
    cfg = drafter_config_from_target(target_config, num_layers=layers, block_size=block_size,
                                     mask_token_id=mask, num_taps=num_taps)
    drafter = DFlashDrafter(cfg).to(dtype)
    drafter.reset_parameters(std=std, generator=torch.Generator().manual_seed(seed))
    return drafter.eval()


class BigramLM(torch.nn.Module):
    """A stand-in target with exactly known conditionals: next-token logits = table[current token].

    Called like an HF causal LM (input_ids, cache, output_hidden_states, logits_to_keep); it records
    one dummy key per position in the cache so cache lengths and crops behave as with a real model.
    """

    def __init__(self, vocab: int, hidden: int, num_layers: int, seed: int, scale: float = 1.5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * scale
        self.embed = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
        self.num_layers = num_layers

    def forward(self, input_ids, cache=None, use_cache=True, output_hidden_states=False, logits_to_keep=0):
        n = input_ids.shape[1]
        cache.update(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), 0)
        logits = self.table[input_ids]  # [1, n, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        hidden = None
        if output_hidden_states:
            hidden = tuple(torch.tanh(self.embed[input_ids] * (i + 1)) for i in range(self.num_layers + 1))
        return SimpleNamespace(logits=logits, hidden_states=hidden)

    def next_probs(self, token: int, temperature: float) -> torch.Tensor:
        return torch.softmax(self.table[token] / temperature, dim=-1)
