"""The torch trainer on one GPU: padded against packed micro-batches, in the same run.

Workload (random-init models with real shapes, bf16 autocast over fp32 master weights, AdamW):
128 samples of 128-1,280 tokens (seeded uniform; the last quarter of each is the response), the
DP schedule's micro-batches of at most 16,384 tokens (`--cap-tokens`), one full train step
(forward + backward of every micro-batch + clip + optimizer step) with a policy-gradient loss on
the response tokens, and one logprob recompute pass (no grad). Per layout: tokens/s (real
tokens, padding excluded), model-FLOPs utilisation = 6 * N * tokens / time / 989 TFLOP/s
(N = every parameter; the dense BF16 peak of an H100/H200 SXM), and the peak allocated GPU
memory.

Layouts: `padded` (right-padded micro-batches with an attention mask: the layout before packing)
and `packed` (one row per micro-batch, variable-length attention, logits in 4,096-row chunks);
`+recompute` adds activation checkpointing. A short torch profiler trace of one packed step
gives GPU kernel time against wall time and the top kernels.

Usage: python -m benchmarks.train_gpu [--presets qwen2.5-0.5b,qwen2.5-3b] [--repeats 3]
       [--layouts padded,packed,packed+recompute] [--cap-tokens 16384,8192]
       [--device cuda|cpu] [--out DIR_OR_FILE.json]
On CPU (`--device cpu --presets tiny`) it checks the script, not the speed.
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rltool.data.models import init_model
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend

from benchmarks import harness
from benchmarks.workloads import make_samples, micro_batches

PEAK_BF16 = 989e12
NUM_SAMPLES = 128
CAP = 16384


def bench_layout(model_dir: Path, device: torch.device, layout: str, *, repeats: int,
                 lengths: tuple[int, int], profile: bool, cap: int = CAP) -> dict:
    name, _, extra = layout.partition("+")
    dtype = "bf16" if device.type == "cuda" else "fp32"
    backend = TorchBackend(model_dir, options=BackendConfig(
        dtype=dtype, lr=1e-6, device=device.type, micro_batch_layout=name,
        recompute="full" if extra == "recompute" else "none"))
    try:
        return measure_layout(backend, device, layout, repeats=repeats, lengths=lengths,
                              profile=profile, cap=cap)
    finally:
        # Free this layout's model and optimizer state (and, on CUDA, the allocator's cached
        # blocks) before the next layout builds its own.
        del backend
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_layout(backend: TorchBackend, device: torch.device, layout: str, *, repeats: int,
                   lengths: tuple[int, int], profile: bool, cap: int) -> dict:
    samples = make_samples(int(backend.config.vocab_size), num=NUM_SAMPLES, lengths=lengths,
                           seed=0)
    batches = micro_batches(samples, cap=cap,
                            response_starts=[len(s) - len(s) // 4 for s in samples])
    tokens = sum(len(t) for mb in batches for t in mb.tokens)
    responses = sum(len(t) - s for mb in batches for t, s in zip(mb.tokens, mb.response_starts))
    params = sum(p.numel() for p in backend.inner.parameters())

    def loss_fn(out, mb):
        loss = sum(-(lp - lp.detach()).exp().sum() for lp in out.logprobs) / responses
        return loss, {"train/loss": loss.detach()}

    def step():
        backend.train_step(batches, loss_fn, temperature=1.0)

    def recompute():
        for mb in batches:
            backend.forward_logprobs(mb, temperature=1.0)

    r = {"layout": layout, "cap_tokens": cap, "params": params, "tokens": tokens,
         "micro_batches": len(batches),
         "padded_tokens": sum(len(mb.tokens) * max(len(t) for t in mb.tokens) for mb in batches)}
    try:
        step()  # warm-up: optimizer state, allocator, kernels
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        r["step_s"] = harness.median_s(step, repeats=repeats, device=device)
        r["peak_gib"] = (torch.cuda.max_memory_allocated(device) / 2**30
                         if device.type == "cuda" else None)
        r["recompute_s"] = harness.median_s(recompute, repeats=1, device=device)
    except torch.OutOfMemoryError as e:
        r["error"] = f"out of memory: {str(e).splitlines()[0]}"
        return r
    r["tokens_per_s"] = tokens / r["step_s"]
    r["mfu"] = 6 * params * tokens / r["step_s"] / PEAK_BF16
    r["recompute_tokens_per_s"] = tokens / r["recompute_s"]
    r["recompute_mfu"] = 2 * params * tokens / r["recompute_s"] / PEAK_BF16
    if profile and device.type == "cuda":
        r["profile"] = profile_step(step, device)
    return r


def profile_step(step, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    harness.sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        harness.sync(device)
    wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernel_us = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:10]
    return {"wall_s_profiled": wall, "gpu_kernel_s": kernel_us / 1e6,
            "top_kernels": [{"name": e.key[:90], "s": e.self_device_time_total / 1e6,
                             "calls": e.count} for e in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--presets", default=None)
    ap.add_argument("--layouts", default="padded,packed,packed+recompute")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap-tokens", default=str(CAP),
                    help="comma-separated micro-batch token caps, each run with every layout")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    presets = (args.presets or ("qwen2.5-0.5b,qwen2.5-3b" if device.type == "cuda" else "tiny")
               ).split(",")
    lengths = (128, 1280) if device.type == "cuda" else (8, 40)
    results = []
    run = harness.Run("train_gpu", device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            model_dir = init_model(Path(tmp) / preset, arch="qwen2", preset=preset,
                                   dtype="bf16" if device.type == "cuda" else "fp32",
                                   device=args.device)
            profiled = False  # the first packed layout of each preset is profiled
            for cap in (int(c) for c in args.cap_tokens.split(",")):
                for layout in args.layouts.split(","):
                    profile = layout.startswith("packed") and not profiled
                    profiled = profiled or profile
                    r = bench_layout(model_dir, device, layout, repeats=args.repeats,
                                     lengths=lengths, profile=profile, cap=cap)
                    r["preset"] = preset
                    results.append(r)
                    harness.progress(json.dumps(r))
    print(f"\n{'preset':14} {'layout':18} {'cap':>6} {'tok/s':>9} {'MFU':>6} {'peak GiB':>9} "
          f"{'recompute tok/s':>16}")
    for r in results:
        if "error" in r:
            print(f"{r['preset']:14} {r['layout']:18} {r['cap_tokens']:6} {r['error']}")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"{r['preset']:14} {r['layout']:18} {r['cap_tokens']:6} {r['tokens_per_s']:9.0f} "
              f"{r['mfu']:6.1%} "
              f"{peak:>9} {r['recompute_tokens_per_s']:16.0f}")
    run.finish({"samples": NUM_SAMPLES, "sample_lengths": list(lengths), "results": results},
               out=args.out)


if __name__ == "__main__":
    main()
