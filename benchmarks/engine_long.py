"""Mode long-context of benchmarks/engine_gpu.py: decode at 16k and 32k tokens per sequence.

Per preset (`--presets`; the Qwen2.5 shapes, random-init bf16 weights) and context C (16,384 and
32,768 tokens) and batch B (0.5B and 3B: 8 and 32; 7B: 8 and 16): a fresh paged runner whose KV
pool holds exactly the batch (`max_total_tokens` = B x (C + one page), no prefix cache, CUDA
graphs up to B); B distinct random prompts of C - 130 tokens prefilled in chunks of 2,048
tokens (timed as a whole; a short untimed request first compiles the kernels); then 2 untimed
and 128 timed decode steps, each fed the previous step's sampled tokens (the GPU sampling
kernel, temperature 1), the last ending at C tokens. Per row: decode
tokens/s (B x 128 over the wall time), ms per step (wall: the forward, the sampler and its one
copy back to the host), GPU ms per step (CUDA events around each decode forward), and the bytes
roofline beside them: per step the weights read once (the embedding table only for the B rows
looked up) plus every request's KV read and its new token's KV written, over the device copy
bandwidth measured in the same run; `roofline_fraction` = roofline ms / GPU ms.

Memory (bf16): KV bytes per token are 12 KiB (0.5B), 36 KiB (3B) and 56 KiB (7B), so the largest
rows hold 12.9 GB (0.5B, B = 32 at 32k), 38.8 GB (3B, B = 32) and 30.2 GB (7B, B = 16) of KV
beside 1, 6.2 and 15.2 GB of weights: each fits an 80 GB card at --mem-fraction-static 0.85.

`--device cpu --quick` is the smoke path of CI: the tiny preset, contexts of 256 and 512 tokens,
B = 2, chunks of 128, 8 decode steps, fp32, the torch sampler; no CUDA events and no roofline (null).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from rltool.engine.batch_sampling import sample_batch
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.sampling import SamplingParams

from benchmarks import harness
from benchmarks.engine_common import copy_bandwidth, prompts_for, random_checkpoint

CONTEXTS = (16384, 32768)
DECODE_STEPS = 128
WARM_STEPS = 2  # untimed decode steps before the timed ones (the batch's graph, the sampler)
# The prefill chunk: a continuation chunk attends to its whole prefix in one masked SDPA call
# (rltool.engine.paged_forward), whose scores [heads, chunk, prefix] stay a few GB at 2,048.
PREFILL_CHUNK = 2048
BATCHES = {"qwen2.5-0.5b": (8, 32), "qwen2.5-3b": (8, 32), "qwen2.5-7b": (8, 16)}
PRESETS = tuple(BATCHES)
# --quick: the tiny preset's 512 positions.
QUICK = {"preset": "tiny", "contexts": (256, 512), "batches": (2,), "steps": 8, "chunk": 128}


def decode_roofline(runner: PagedRunner, batch: int, *, context: int, steps: int,
                    bw: float) -> float:
    """Seconds per decode step at the bytes roofline, averaged over the `steps` steps that end
    at `context` tokens: weights read once (the embedding only for `batch` rows, so an untied
    table is left out and a tied one counts as the head), each request's KV read (its mean
    length over the steps) and one token of KV written."""
    spec = runner.spec
    elem = 2 if runner.dtype == "bf16" else 4
    table = spec.vocab_size * spec.hidden_size * elem
    weights = runner.model.nbytes() - (0 if spec.tie_word_embeddings else table)
    mean_len = context - (steps - 1) / 2
    kv = batch * (mean_len + 1) * runner.kv_bytes_per_token
    return (weights + kv) / bw


def prefill(runner: PagedRunner, prompts: list[list[int]], *, chunk: int) -> float:
    """Every prompt's KV in chunks of `chunk` tokens, a forward per chunk; seconds."""
    harness.sync(runner.device)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        for start in range(0, len(prompt), chunk):
            runner.prefill([(f"r{i}", prompt[start:start + chunk], start)], want=[False])
    harness.sync(runner.device)
    return time.perf_counter() - t0


def decode_steps(runner: PagedRunner, rids: list[str], first: list[int], steps: int,
                 *, seed: int) -> dict:
    """`steps` decode steps fed the sampled tokens: wall seconds in all, and on CUDA the GPU
    seconds of the forwards (an event pair around each)."""
    cuda = runner.device.type == "cuda"
    batch = len(rids)
    params = [SamplingParams(temperature=1.0)] * batch
    kw = dict(generators=[None] * batch, suppressed=[[]] * batch, top_n=[0] * batch,
              token_ids=[None] * batch, use_kernel=cuda,
              shared_generator=torch.Generator(device=runner.device).manual_seed(seed))
    events = ([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(steps)] if cuda else [])
    tokens = first
    harness.sync(runner.device)
    t0 = time.perf_counter()
    for step in range(steps):
        if cuda:
            events[step][0].record()
        logits = runner.decode(rids, tokens)
        if cuda:
            events[step][1].record()
        seeds = [(seed * 1_000_003 + step * batch + i) % (1 << 31) for i in range(batch)]
        tokens = sample_batch(logits.float(), params, seeds=seeds, **kw).tokens
    harness.sync(runner.device)
    wall = time.perf_counter() - t0
    gpu = sum(a.elapsed_time(b) for a, b in events) / 1e3 if cuda else None
    return {"wall_s": wall, "gpu_s": gpu, "tokens": tokens}


def warm_up(runner: PagedRunner, *, seed: int) -> None:
    """A short request prefilled in two chunks and decoded WARM_STEPS steps, then removed: the
    Triton kernels of prefill, continuation and the sampler compile here, not in a timed run."""
    ids = prompts_for(1, runner.vocab_size, seed + 7, length=64)[0]
    runner.prefill([("warm", ids[:32], 0)], want=[False])
    runner.prefill([("warm", ids[32:], 32)], want=[False])
    decode_steps(runner, ["warm"], [ids[0]], WARM_STEPS, seed=seed)
    runner.remove("warm")


def one_row(model_dir: Path, *, device: str, batch: int, context: int, steps: int,
            chunk: int, bw: float | None, seed: int) -> dict:
    """A fresh runner holding exactly `batch` sequences of `context` tokens; prefill, then
    `steps` timed decode steps ending at `context` tokens."""
    page = 16
    runner = PagedRunner(model_dir, device=device, dtype="bf16" if device == "cuda" else "fp32",
                         max_running=batch, page_size=page, cuda_graph_max_bs=batch,
                         max_total_tokens=batch * (context + page) + page, prefix_cache=False)
    try:
        warm_up(runner, seed=seed)
        prompts = prompts_for(batch, runner.vocab_size, seed,
                              length=context - steps - WARM_STEPS)
        prefill_s = prefill(runner, prompts, chunk=chunk)
        rids = [f"r{i}" for i in range(batch)]
        rng = random.Random(seed)
        first = [rng.randrange(runner.vocab_size // 4, runner.vocab_size // 2)
                 for _ in range(batch)]
        first = decode_steps(runner, rids, first, WARM_STEPS, seed=seed + 1)["tokens"]
        timed = decode_steps(runner, rids, first, steps, seed=seed)
        assert all(runner.table.entries[r].length == context for r in rids)
        roof = (decode_roofline(runner, batch, context=context, steps=steps, bw=bw)
                if bw is not None else None)
        gpu_ms = timed["gpu_s"] * 1e3 / steps if timed["gpu_s"] is not None else None
        return {"batch": batch, "context": context, "prefill_tokens": sum(map(len, prompts)),
                "prefill_s": prefill_s,
                "prefill_tokens_per_s": sum(map(len, prompts)) / prefill_s,
                "decode_steps": steps, "tokens_per_s": batch * steps / timed["wall_s"],
                "ms_per_step": timed["wall_s"] * 1e3 / steps, "gpu_ms_per_step": gpu_ms,
                "roofline_ms_per_step": roof * 1e3 if roof is not None else None,
                "roofline_fraction": (roof * 1e3 / gpu_ms
                                      if roof is not None and gpu_ms else None),
                "kv_pool_tokens": runner.max_total_num_tokens,
                "kv_bytes_per_token": runner.kv_bytes_per_token,
                "weight_bytes": runner.model.nbytes()}
    finally:
        runner.release()
        del runner
        if device == "cuda":
            torch.cuda.empty_cache()


def long_context(presets: list[str], *, device: str, quick: bool) -> dict:
    """Every row of the mode; `quick`: the tiny preset's smoke rows."""
    if quick:
        presets = [QUICK["preset"]]
    else:
        unknown = [p for p in presets if p not in BATCHES]
        if unknown:
            print(f"--mode long-context: no batch sizes for {unknown}; choose from "
                  f"{', '.join(PRESETS)} (or --quick)", file=sys.stderr)
            raise SystemExit(2)
    bw = copy_bandwidth() if device == "cuda" else None
    steps = QUICK["steps"] if quick else DECODE_STEPS
    chunk = QUICK["chunk"] if quick else PREFILL_CHUNK
    rows = []
    for preset in presets:
        harness.progress(f"long-context: {preset} checkpoint")
        model_dir = random_checkpoint(Path(tempfile.mkdtemp()) / preset, preset,
                                      device=device)
        contexts = QUICK["contexts"] if quick else CONTEXTS
        batches = QUICK["batches"] if quick else BATCHES[preset]
        for context in contexts:
            for batch in batches:
                harness.progress(f"long-context: {preset} B={batch} context={context}")
                row = {"preset": preset, **one_row(model_dir, device=device, batch=batch,
                                                   context=context, steps=steps, chunk=chunk,
                                                   bw=bw, seed=context + batch)}
                rows.append(row)
                harness.progress(f"  {row['tokens_per_s']:.0f} tok/s, "
                                 f"{row['ms_per_step']:.2f} ms/step")
    harness.print_table(
        ["preset", "B", "context", "prefill tok/s", "tok/s", "ms/step", "GPU ms/step",
         "roofline ms", "fraction"],
        [[r["preset"], r["batch"], r["context"], r["prefill_tokens_per_s"], r["tokens_per_s"],
          r["ms_per_step"], r["gpu_ms_per_step"], r["roofline_ms_per_step"],
          r["roofline_fraction"]] for r in rows])
    return {"copy_bandwidth_bytes_per_s": bw, "decode_steps": steps,
            "prefill_chunk": chunk, "quick": quick, "rows": rows}
