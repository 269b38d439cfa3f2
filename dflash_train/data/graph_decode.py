"""Greedy decoding with taps at one fixed shape, each step replayed as a CUDA graph.

`regen_taps._generate_batch` drops finished rows and grows a DynamicCache: right on a CPU, where a
step costs what its rows cost, but on a GPU the step is host-bound. For SmolLM2-135M at batch 1024
on an H200 it made 10.3K new tokens/s (docs/LOG.md, session 8): ~30 launches per layer from Python,
a cache copied on every growth and every row drop, and a host sync per step. Here every shape is
fixed for the whole regeneration: a batch of `batch_size` rows (a short last batch is padded with
dummy rows), a `StaticCache` of `cache_len` slots written in place, and a 4D additive mask in a
buffer whose next column opens before each step. The decode step is then one `torch.cuda.CUDAGraph`
replay plus a few copies; finished rows keep decoding (their tokens are ignored), the host checks
for "all done" every `SYNC_EVERY` steps, and the tokens and taps stay on the GPU until the batch ends.

The cache's length is the batch's need (widest prompt + new tokens) rounded up to `LENGTH_BUCKET`:
the per-step cost is the attention's read of the whole cache, and sorted batches mostly need a
third of the first one's (SmolLM2's default prompts: 45 tokens median, 317 the widest). A graph is
captured per length bucket (a handful per run), after that bucket's first step ran eagerly on a
side stream (the warm-up CUDA graphs need); the cache's own write position (`cumulative_length`,
a tensor the captured `index_copy_` reads and advances) therefore already points at the second
step's slot, and `Cache.reset()` (in place, addresses kept) rewinds it for the next prefill.

The decode step attends with `grouped_query_decode`: transformers' SDPA path repeats the K/V
heads of the whole cache for every layer and step whenever a mask is given (`use_gqa_in_sdpa`),
which at batch 1024 costs more than the step's matmuls. Only targets whose layers are all full
attention take this path (`supports`); the rest keep the dynamic loop.
Equality with the dynamic loop (tokens, taps, final hidden states): tests/data/test_graph_decode.py.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from transformers import (AttentionInterface, AttentionMaskInterface, LogitsProcessorList, StaticCache,
                          TemperatureLogitsWarper, TopPLogitsWarper)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from dflash_train.model.target.decoding import cache_kwarg, mask_positions

SYNC_EVERY = 16  # decode steps between the host's "are all rows done?" checks
LENGTH_BUCKET = 64  # cache lengths are rounded up to this: one graph per bucket
DECODE_ATTENTION = "grouped_query_decode"  # no "flash" in it: transformers reads that as a kernel name


def grouped_query_decode(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of one new token per row over a static cache, each K/V head read once for the
    query heads that share it (HF's attention-function signature: query [b, H, 1, D], key/value
    [b, KV, L, D], additive mask [b, 1, 1, L]; returns ([b, 1, H, D], None)). Longer queries
    (a prefill) go to SDPA."""
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    grouped = query.reshape(b, kv_heads, heads // kv_heads, dim)  # query head h uses K/V head h // group
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * (scaling or dim ** -0.5)  # [b, KV, group, L]
    if attention_mask is not None:  # [b, 1, 1, L] over the groups: additive, or boolean (True attends)
        mask = attention_mask[:, :, :, :key.shape[-2]]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
            else scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [b, KV, group, D]
    return out.reshape(b, 1, heads, dim), None


AttentionInterface.register(DECODE_ATTENTION, grouped_query_decode)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


def draw(logits: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    """One token per row [b] from the distribution the warpers shape out of logits [b, V] (temperature,
    top-p), by the exponential race: argmax of p / E with E ~ Exp(1) is a draw from p, and it is one
    RNG op that a CUDA graph replays (with fresh random numbers at each replay)."""
    probs = torch.softmax(warpers(None, logits.float()), dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def bucket_length(need: int) -> int:
    """`need` cache slots rounded up to the length bucket: one cache and one graph per bucket."""
    return -(-need // LENGTH_BUCKET) * LENGTH_BUCKET


class CapturedStep:
    """A step over fixed buffers, replayed as a CUDA graph: the first call runs it eagerly on a side
    stream (the warm-up capture asks for; its results are that call's), then records it, and every later
    call replays the recording. `step` must read and write only tensors whose addresses stay fixed and
    must not sync with the host. `use_graph=False` (a CPU) runs it eagerly every time; a capture that
    fails (e.g. a forward that syncs with the host) says so once, naming `what`, and runs eagerly after."""

    def __init__(self, step, use_graph: bool, what: str):
        self.step, self.use_graph, self.what = step, use_graph, what
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        if not self.use_graph:
            self.step()
            return
        self._warm_up()  # this call's results, computed eagerly
        try:
            self.graph = self._capture()
        except RuntimeError as e:
            self.use_graph = False
            cause = e.__context__ or e  # the op that broke the capture, not "failed due to a previous error"
            print(f"{self.what}: CUDA graph capture of the decode step failed ({str(cause).splitlines()[0]}); "
                  "decoding eagerly at the fixed shape", flush=True)

    def _warm_up(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Records the step (nothing runs: the warm-up computed this call; each replay is the next)."""
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph):
                self.step()
        except RuntimeError:
            torch.cuda.set_stream(stream)  # a failed capture_end leaves the capture stream current
            torch.cuda.synchronize()
            raise
        return graph


@contextlib.contextmanager
def decode_attention(model):
    """The model attends with `grouped_query_decode` inside (one-token steps; longer queries: SDPA)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(DECODE_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def supports(model) -> bool:
    """Plain single-device targets whose every layer attends to the whole cache."""
    text = getattr(model.config, "text_config", None) or model.config
    types = getattr(text, "layer_types", None) or ()
    full = all(t == "full_attention" for t in types) and not getattr(text, "sliding_window", None)
    return full and not any(isinstance(p, DTensor) for p in model.parameters())


class GraphDecoder:
    """Decoding of batches of prompts with the tapped hidden states of every fed token: greedy, or
    sampled with `sampling=(temperature, top_p)` (the target writing prompts: data/synthesize.py).

    `select(hidden_states) -> {name: [b, S, width]}` picks what is kept per position (taps, final
    hidden state). `use_graph=False` runs the same static steps eagerly (CPU tests)."""

    def __init__(self, model, select, batch_size: int, stop_ids: list[int], pad_id: int, use_graph: bool,
                 sampling: tuple[float, float] | None = None):
        self.model, self.select, self.batch = model, select, batch_size
        self.pad_id, self.use_graph = pad_id, use_graph
        self.warpers = None if sampling is None else \
            LogitsProcessorList([TemperatureLogitsWarper(sampling[0]), TopPLogitsWarper(sampling[1])])
        device = model.get_input_embeddings().weight.device
        self.stops = torch.tensor(stop_ids, device=device)
        self.cache_arg = cache_kwarg(type(model))
        self.dtype = model.get_input_embeddings().weight.dtype
        self.masked = torch.finfo(self.dtype).min
        self.tok = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.runner: CapturedStep | None = None
        self.cache_len = 0  # set per length bucket by `_fit`, with the cache, the mask and the graph

    def _fit(self, need: int) -> None:
        """A cache (and mask buffer, and graph) of `need` slots rounded up to the bucket."""
        length = bucket_length(need)
        if length == self.cache_len:
            return
        if self.runner is not None and not self.runner.use_graph:
            self.use_graph = False  # a capture failed once: the next bucket's would too
        # the old bucket's memory goes first; `out` holds the step's results at the graph's fixed addresses
        self.runner, self.cache, self.out = None, None, {}
        self.cache = StaticCache(config=self.model.config, max_cache_len=length)
        self.mask = torch.full((self.batch, 1, 1, length), self.masked, dtype=self.dtype, device=self.tok.device)
        self.cache_len = length
        self.runner = CapturedStep(self._step, self.use_graph, "regenerate")

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row from its logits [b, V]: the argmax, or a sampled draw."""
        return logits.argmax(-1) if self.warpers is None else draw(logits, self.warpers)

    def _forward(self, ids, mask, positions):
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          output_hidden_states=True, logits_to_keep=1, **{self.cache_arg: self.cache})

    def _step(self) -> None:
        with decode_attention(self.model):  # what runs at capture is what every replay runs
            out = self._forward(self.tok, self.mask, self.pos)
        results = {name: t[:, 0] for name, t in self.select(out.hidden_states).items()}  # name -> [b, width]
        results["next"] = self.pick(out.logits[:, -1])
        for name, t in results.items():
            if name in self.out:
                self.out[name].copy_(t)
            else:
                self.out[name] = t.clone()

    def _run_step(self) -> None:
        self.runner()  # a method of its own: bench/regenerate.py times it

    def _prefill(self, prompts: list[list[int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """Writes the left-padded prompts into the cache; returns ({name: [B, width, D]}, first
        tokens [B], width)."""
        rows = prompts + [[self.pad_id]] * (self.batch - len(prompts))  # dummy rows keep the shape
        width = max(len(p) for p in rows)
        pad = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=self.mask.device)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in rows], device=self.mask.device)
        causal = torch.ones(width, width, dtype=torch.bool, device=pad.device).tril()
        allowed = causal[None] & pad[:, None, :].bool()  # [B, width(query), width(key)]
        mask = torch.full((self.batch, 1, width, self.cache_len), self.masked, dtype=self.mask.dtype,
                          device=pad.device)
        mask[:, 0, :, :width].masked_fill_(allowed, 0.0)
        self.cache.reset()
        out = self._forward(ids, mask, mask_positions(pad))
        self.mask.fill_(self.masked)
        self.mask[:, 0, 0, :width].masked_fill_(pad.bool(), 0.0)
        self.pos.copy_(pad.sum(-1, keepdim=True))
        return self.select(out.hidden_states), self.pick(out.logits[:, -1]), width

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype | None = None):
        """(responses up to and including the first stop token, {name: [sum of rows' lengths, D]} on the CPU in
        `dtype` (None: as computed)): each row's kept positions end to end (`packed_rows`)."""
        self._fit(max(len(p) for p in prompts) + max_new_tokens)
        prompt_tensors, first, width = self._prefill(prompts)
        steps = max(min(max_new_tokens, self.cache_len - width + 1), 1)
        tokens = torch.empty(self.batch, steps, dtype=torch.long, device=first.device)
        tokens[:, 0] = first
        fed = {name: torch.empty(self.batch, steps - 1, t.shape[-1], dtype=t.dtype, device=t.device)
               for name, t in prompt_tensors.items()}  # name -> [B, steps - 1, D]
        done, ran = torch.isin(first, self.stops), 0
        while ran < steps - 1 and not (ran % SYNC_EVERY == 0 and bool(done[:len(prompts)].all())):
            self.tok.copy_(tokens[:, ran:ran + 1])
            self.mask[:, 0, 0, width + ran] = 0.0
            self._run_step()
            self.pos.add_(1)
            for name, buf in fed.items():
                buf[:, ran].copy_(self.out[name])
            tokens[:, ran + 1] = self.out["next"]
            done |= torch.isin(self.out["next"], self.stops)
            ran += 1
        responses = self._responses(tokens[:len(prompts), :ran + 1].tolist())
        return responses, {name: packed_rows(prompt_tensors[name], fed[name], prompts, responses, dtype).cpu()
                           for name in prompt_tensors}

    def _responses(self, tokens: list[list[int]]) -> list[list[int]]:
        stops = set(self.stops.tolist())
        responses = []
        for row in tokens:
            stop = next((i for i, t in enumerate(row) if t in stops), None)
            responses.append(row if stop is None else row[:stop + 1])
        return responses


def _ranges(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, offset) of every element of consecutive ranges of `lengths`: [sum] each."""
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return owner, torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths)[owner]


def packed_rows(prompt: torch.Tensor, fed: torch.Tensor, prompts: list[list[int]], responses: list[list[int]],
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each row's positions end to end, [sum of len(prompt) + len(response), D], on the tensors' device: its
    prompt positions (left-padded in prompt [B, width, D]), its fed response positions (fed [B, steps, D]: token
    k's state is computed when it is fed back, so a response of n tokens has n - 1) and a zero row for the last
    response token, which is never fed back. Two gathers instead of a tensor per row: the regeneration's host
    copied every row of a 1024-row batch once to the CPU padded, then again into its own tensor."""
    width, steps, dim = prompt.shape[1], fed.shape[1], prompt.shape[-1]
    p_len = torch.tensor([len(p) for p in prompts])
    f_len = torch.tensor([len(r) - 1 for r in responses])
    lengths = p_len + f_len + 1
    starts = torch.cumsum(lengths, 0) - lengths
    out = torch.zeros(int(lengths.sum()), dim, dtype=dtype or prompt.dtype, device=prompt.device)
    row, j = _ranges(p_len)
    src, dst = row * width + width - p_len[row] + j, starts[row] + j
    out.index_copy_(0, dst.to(out.device), prompt.reshape(-1, dim).index_select(0, src.to(out.device)).to(out.dtype))
    row, j = _ranges(f_len)
    src, dst = row * steps + j, starts[row] + p_len[row] + j
    out.index_copy_(0, dst.to(out.device), fed.reshape(-1, dim).index_select(0, src.to(out.device)).to(out.dtype))
    return out
