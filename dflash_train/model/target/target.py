"""The frozen target once loaded (model/target/load.py): its shape, and taps of its hidden states.

Tap ids use z-lab semantics (see `model/target/taps.py`): id i is the output of decoder layer i, HF
`output_hidden_states[i + 1]`; a tap of id L-1 is returned after the final norm, as HF's is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_train.fp8 import describe_conversion, fp8_fits, require_fp8, split_linears
from dflash_train.model.target.scaling import Scaling, scale_embeddings, scale_logits
from dflash_train.model.target.taps import check_layer_ids, hidden_state_index, select_taps
from dflash_train.model.target.subset import held_parameter_names

SCALING_PROBE_TOKENS = 8  # token ids 0..7 through the target: its embedding and logit scaling, measured
SCALING_RTOL = 2e-2  # of the largest value; Gemma rounds its embedding scale to the weights' dtype (bf16: 0.2%)


# ---------------------------------------------------------------------------------------------
# The loaded target


class _StopForward(Exception):
    """Raised by a tap hook once the last needed layer ran, to skip the remaining layers."""


@dataclass
class Target:
    """A frozen HF causal LM plus its tokenizer, with tap extraction.

    Conventions: taps are in the target dtype, layer ids in z-lab semantics (see module doc),
    `lm_head_weight` is the very same tensor as `embed_weight` when embeddings are tied.
    """

    model: nn.Module
    tokenizer: object
    name: str = "target"

    @property
    def config(self):
        return self.model.config

    @property
    def decoder(self) -> nn.Module:
        return self.model.get_decoder()

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.embed_weight.shape[1])

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding (may exceed `len(tokenizer)`)."""
        return int(self.embed_weight.shape[0])

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def final_norm(self) -> nn.Module:
        return self.decoder.norm

    def held_parameters(self) -> list[str]:
        """Names of the weights this process holds: every one, or a drafter rank's subset (the
        rest on the meta device; `load_target(subset=)`). Tied weights appear under each name."""
        return held_parameter_names(self.model)

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @torch.no_grad()
    def taps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids,
             return_last_hidden: bool = False):
        """Concatenated outputs of decoder layers `layer_ids`: (b, S, K*H), in the target dtype.

        The forward stops right after the last tapped layer unless `return_last_hidden`, in which
        case it runs to the end and returns `(taps, last_hidden)` with `last_hidden` (b, S, H) after
        the final norm, so teacher logits are `last_hidden @ lm_head_weight.T`.
        Positions follow `attention_mask` (cumsum - 1), so left-padded rows match unpadded ones.
        """
        layer_ids = check_layer_ids(layer_ids, self.num_layers)
        recorded: dict[int, torch.Tensor] = {}  # HF hidden_states index -> (b, S, H)
        last_needed = max(layer_ids)
        handles = [self._record_hook(i, recorded, stop=(i == last_needed and not return_last_hidden))
                   for i in sorted(set(layer_ids))]
        try:
            out = self._run_decoder(input_ids, attention_mask)
        except _StopForward:
            out = None
        finally:
            for h in handles:
                h.remove()
        if self.num_layers in recorded:  # HF hidden_states[L] is post-norm: match it
            recorded[self.num_layers] = self.final_norm(recorded[self.num_layers])
        taps = select_taps(recorded, layer_ids)  # (b, S, K*H)
        if return_last_hidden:
            return taps, out.last_hidden_state
        return taps

    def compile_layers(self) -> None:
        """Compile the parts of each decoder layer (attention, MLP, norms) with `Module.compile`;
        the layer's own call stays eager, so the tap hooks on it (which stop the forward by
        raising) run outside the compiled frames. Dynamo inlines nn.Modules (guards on shapes, not
        identities), so one graph per kind of part serves every layer. On an H200 the eager norms,
        RoPE and SwiGLU were a third of a prefill's device time (docs/PERF.md). Static shapes: for
        training taps, not for generation; run generation under
        `torch.compiler.set_stance("force_eager")`, which skips the compiled code.
        An HF call with output_hidden_states/output_attentions installs capture hooks on the
        attention modules that dynamo cannot trace (a graph break per layer, reported by the
        compile-health check): the trainer never makes one on the target it compiles."""
        for layer in self.layers:
            for part in layer.children():
                part.compile(dynamic=False)

    def quantize_fp8(self, granularity: str = "rowwise", log=print) -> list[str]:
        """Run the decoder layers' linear layers in float8 (`target.precision=fp8`), in place:
        weights quantized once to e4m3 with one scale per output row (`rowwise`) or per tensor
        (`tensorwise`), activations scaled dynamically per row (per tensor) at every call, through
        torchao float8 inference. Embedding, norms and lm_head stay as they are (taps and logits
        keep their precision); layers whose dims are not multiples of 16 are kept too. Call once
        after loading, before `compile_layers`. Returns the converted layers' names."""
        require_fp8(self.device, "target.precision")
        # optional dependency (the `fp8` extra), imported only when FP8 is asked for
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

        scales = {"rowwise": PerRow, "tensorwise": PerTensor}
        if granularity not in scales:
            raise ValueError(f"fp8 granularity {granularity!r}: expected one of {', '.join(scales)}")
        converted, skipped = split_linears(self.layers)
        # set_inductor_config=False: keep the inductor settings the drafter's compile was tuned with
        quantize_(self.layers, Float8DynamicActivationFloat8WeightConfig(
            granularity=scales[granularity](), set_inductor_config=False), filter_fn=fp8_fits)
        log(describe_conversion(f"target {self.name} decoder layers", granularity, converted, skipped, self.layers))
        return converted

    @torch.no_grad()
    def scaling_problems(self, scaling: Scaling, rtol: float = SCALING_RTOL) -> list[str] | None:
        """How the target's own forward differs from `scaling` (model/target/scaling.py), one line per field, []
        when it agrees; None when this process cannot run the whole target (a subset, a pipeline stage or
        a tensor-parallel shard: the rank that can checks it). The input of the first decoder layer must be
        the embedding rows times `input_embedding_scale`, and the logits the final hidden state's lm_head
        scores times `output_multiplier`, soft-capped by `final_logit_softcapping`."""
        from torch.distributed.tensor import DTensor

        if type(self) is not Target or any(p.is_meta or isinstance(p, DTensor) for p in self.model.parameters()):
            return None
        ids = torch.arange(SCALING_PROBE_TOKENS, device=self.device)[None] % self.vocab_size  # [1, n]
        first: list[torch.Tensor] = []
        hook = self.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: first.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        try:
            hidden = self.decoder(input_ids=ids, use_cache=False).last_hidden_state  # [1, n, H]
        finally:
            hook.remove()
        logits = self.model(input_ids=ids, use_cache=False).logits.float()  # [1, n, V]
        embeds = scale_embeddings(self.embed_weight[ids].float(), scaling.input_embedding_scale)
        scores = scale_logits(hidden.float() @ self.lm_head_weight.float().T, scaling.output_multiplier,
                              scaling.final_logit_softcapping)
        out = []
        if first[0].shape != embeds.shape or _rel_err(first[0].float(), embeds) > rtol:
            out.append(f"input_embedding_scale: its first decoder layer does not read its embedding rows times "
                       f"{scaling.input_embedding_scale:g} ({_mismatch(first[0], embeds)}), which is all "
                       "dflash_config.input_embedding_scale can express")
        if _rel_err(logits, scores) > rtol:
            out.append(f"output_multiplier / final_logit_softcapping: its logits are not lm_head(h) x "
                       f"{scaling.output_multiplier:g}, soft-capped at {scaling.final_logit_softcapping} "
                       f"({_mismatch(logits, scores)}), which is all those fields can express")
        return out

    def _record_hook(self, layer_id: int, recorded: dict, stop: bool):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output  # (b, S, H)
            recorded[hidden_state_index(layer_id)] = hidden
            if stop:
                raise _StopForward

        return self.layers[layer_id].register_forward_hook(hook)

    def _run_decoder(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        input_ids = input_ids.to(self.device)
        position_ids = None
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (b, S)
        return self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False)


@torch.no_grad()
def norm_factor(norm: nn.Module) -> torch.Tensor | None:
    """The per-channel factor an RMS norm multiplies by, as a `x * w` weight: its weight where it is
    one (Llama, Qwen), `1 + weight` for Gemma's `x * (1 + w)`; measured as the norm's output on a
    constant input (whose RMS-normalised value is all ones). None for another kind of norm or a weight
    this process does not hold."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.is_meta:
        return None
    out = norm(torch.full((1, weight.shape[-1]), 1e3, dtype=weight.dtype, device=weight.device))[0].float()
    for factor in (weight.float(), 1.0 + weight.float()):
        if torch.allclose(out, factor, rtol=1e-2, atol=1e-3):
            return factor
    return None


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return f"max relative difference {_rel_err(got.float(), want):.2g}"


def tap_relative_errors(reference: torch.Tensor, taps: torch.Tensor, num_taps: int) -> list[float]:
    """Per tapped layer, ||taps - reference||_F / ||reference||_F over all rows and positions:
    how far taps (e.g. from an FP8 target) are from reference taps (bf16), both (b, S, K*H)."""
    if reference.shape != taps.shape:
        raise ValueError(f"taps {tuple(taps.shape)} and reference {tuple(reference.shape)} differ in shape")
    errors = []
    for ref, got in zip(reference.float().chunk(num_taps, dim=-1), taps.float().chunk(num_taps, dim=-1)):
        errors.append(float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref).clamp(min=1e-30)))
    return errors


# ---------------------------------------------------------------------------------------------
# Mask token (spec 1.4)

_RESERVED_HINTS = ("mask", "reserved", "unused", "fim_pad")


def _reserved_special_token(tokenizer) -> tuple[int, str] | None:
    """A special added token that never occurs in chat text: not bos/eos/pad/unk, not in the chat
    template. Prefers names that say reserved/unused/mask; else the highest such id."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    in_use = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    candidates = [(i, str(tok)) for i, tok in sorted(decoder.items())
                  if getattr(tok, "special", False) and i not in in_use and str(tok) not in template]
    if not candidates:
        return None
    hinted = [c for c in candidates if any(h in c[1].lower() for h in _RESERVED_HINTS)]
    return hinted[0] if hinted else candidates[-1]


def resolve_mask_token_id(tokenizer, vocab_size: int, explicit: int | None = None) -> int:
    """The mask token id, spec 1.4 order: explicit, `tokenizer.mask_token_id`, the first unused
    embedding row `len(tokenizer)` when the table is larger, else a reserved special token that
    never occurs in chat text. Embeddings are never resized (a new row would be neither trained
    nor exported)."""
    mask_id, why = None, ""
    if explicit is not None:
        mask_id, why = int(explicit), "given explicitly"
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        mask_id, why = int(tokenizer.mask_token_id), "the tokenizer's mask token"
    elif len(tokenizer) < vocab_size:
        mask_id, why = len(tokenizer), f"first unused embedding row (len(tokenizer)={len(tokenizer)})"
    else:
        reserved = _reserved_special_token(tokenizer)
        if reserved is None:
            raise ValueError("no mask token: the tokenizer has no mask token, no unused embedding row "
                             "and no reserved special token; pass drafter.mask_token_id=ID")
        mask_id = reserved[0]
        why = (f"reserved special token {reserved[1]!r}: no mask token and no unused embedding row "
               f"(len(tokenizer)={len(tokenizer)} = vocab), and it never occurs in chat text")
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_token_id {mask_id} ({why}) is outside the embedding table [0, {vocab_size})")
    print(f"target: mask_token_id = {mask_id}, {why}", flush=True)
    return mask_id
