"""Point-to-point bandwidth between two processes, the way taps travel from target to drafter ranks."""

from __future__ import annotations

import faulthandler
import multiprocessing
import signal
import sys
import time
from datetime import timedelta

# One micro-batch of taps: tokens x taps x hidden x bytes. Full size is a 3072-token row of an 8B
# target (Qwen3-8B: 5 taps x 4096, bf16); --quick uses SmolLM2-135M (5 x 576, fp32 on CPU).
TAPS = {False: (3072, 5, 4096, 2), True: (1024, 5, 576, 4)}


def taps_bytes(backend: str, quick: bool) -> tuple[int, str]:
    """(bytes, description) of the tensor to send."""
    tokens, taps, hidden, nbytes = TAPS[quick and backend == "gloo"]
    return tokens * taps * hidden * nbytes, f"taps of {tokens} tokens x {taps} x {hidden}"


def run_pair(backend: str, nbytes: int, iters: int, port: int) -> dict:
    """Rank 0 here, rank 1 in a spawned process (one torch import fewer than spawning both)."""
    peer = multiprocessing.get_context("spawn").Process(
        target=p2p_rank, args=(1, 2, port, backend, nbytes, iters), name="p2p-rank1", daemon=True)
    peer.start()
    try:
        figures = p2p_rank(0, 2, port, backend, nbytes, iters)
    finally:
        peer.join(timeout=60)
    if peer.exitcode != 0:
        raise RuntimeError(f"p2p rank 1 exited with code {peer.exitcode} (its traceback is above)")
    return figures


def p2p_rank(rank: int, world: int, port: int, backend: str, nbytes: int, iters: int) -> dict:
    """One rank: rank 0 sends `iters` times, rank 1 receives; returns the figures (rank 0's are used)."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # the doctor may ask
    # local, after the handler: a hung torch/NCCL import in this child can then be dumped
    import torch
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # A bounded timeout: if the peer dies, this rank fails instead of waiting out the stage limit.
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ms = _timed_sends(dist, buf, rank, iters, device)
    finally:
        dist.destroy_process_group()
    route = "cuda:0 -> cuda:1" if device.type == "cuda" else "cpu -> cpu"
    return {"route": route, "ms_per_send": ms, "gb_per_s": nbytes / (ms / 1e3) / 1e9}


def _timed_sends(dist, buf, rank: int, iters: int, device) -> float:
    """ms per send, after one untimed send that sets up the connection."""
    import torch  # local: see p2p_rank

    def once() -> None:
        if rank == 0:
            dist.send(buf, dst=1)
        else:
            dist.recv(buf, src=0)

    once()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()  # rank 0 stops the clock only once rank 1 has everything
    return (time.perf_counter() - t0) / iters * 1e3
