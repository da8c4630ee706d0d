"""Mode rl of benchmarks/engine_gpu.py (`--grpo PRESETS`, `--tensor-sync PRESETS`).

(b) GRPO-shaped generation: P prompts x S samples (64 x 8 by default), random L-token prompts
(512), each request's output length drawn from a seeded lognormal (mu = ln 512, sigma = 0.8:
median 512 tokens, mean ~705 before the cap), rounded, at least 1 and capped at 2,048, enforced
with ignore_eos and the request's own max_new_tokens; all P x S requests submitted at once to the
scheduler in process, the S samples of a prompt next to each other. Run twice on fresh engines,
with the prefix cache and without (`--disable-radix-cache`): prefill tokens computed (the
scheduler's `num_prefill_tokens`) against the unique prompt tokens P x L, end-to-end seconds,
output tokens/s.

Tensor sync: this process holds a model's tensors on the device (new bf16 values, the
checkpoint's names and shapes) and hands them to a running `rltool serve` through
/update_weights_from_tensor, a bucket per call (512 MiB by default): CUDA IPC handles of one
device buffer on cuda, one shared-memory segment on cpu. Timed end to end (buffer, copies,
requests, the engine's checks and copies), three times; beside it the in-process bound, the
runner's `load_named_tensors` from the same device tensors, after the server has stopped.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler

from benchmarks.engine_common import prompts_for, submit_and_wait

LOGNORMAL_MU = math.log(512)
LOGNORMAL_SIGMA = 0.8
REPEATS = 3


def output_lengths(n: int, *, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(cap, max(1, round(rng.lognormvariate(LOGNORMAL_MU, LOGNORMAL_SIGMA))))
            for _ in range(n)]


def grpo_workload(model_dir: Path, *, device: str, prompts: int, samples: int, prompt_len: int,
                  max_output: int, seed: int = 0) -> dict:
    n = prompts * samples
    lengths = output_lengths(n, cap=max_output, seed=seed)
    out: dict = {"prompts": prompts, "samples": samples, "prompt_len": prompt_len,
                 "unique_prompt_tokens": prompts * prompt_len,
                 "lognormal": {"mu": LOGNORMAL_MU, "sigma": LOGNORMAL_SIGMA, "cap": max_output,
                               "seed": seed},
                 "output_len": {"mean": statistics.mean(lengths),
                                "median": statistics.median(lengths), "max": max(lengths),
                                "capped": sum(x == max_output for x in lengths)}}
    for arm, cache in (("prefix_cache", True), ("no_prefix_cache", False)):
        runner = PagedRunner(model_dir, device=device, dtype="bf16" if device == "cuda" else "fp32",
                             max_running=n, cuda_graph_max_bs=n, prefix_cache=cache)
        sched = PagedScheduler(runner, max_running=n, max_prefill_tokens=16384,
                               chunked_prefill_size=8192)
        sched.start()
        try:
            vocab = runner.vocab_size
            # The warm-up is the workload itself on other prompts with outputs an eighth as long:
            # the kernels specialised for its shapes (the cached groups' one-token continuations,
            # the sampler at every batch size the run shrinks through) compile here, not in
            # whichever arm runs first.
            warm = [p for p in prompts_for(prompts, vocab, seed + 1, length=prompt_len)
                    for _ in range(samples)]
            submit_and_wait(sched, warm, [max(1, n // 8) for n in lengths])
            group = prompts_for(prompts, vocab, seed + 2, length=prompt_len)
            batch = [p for p in group for _ in range(samples)]
            pre0, fw0 = sched.num_prefill_tokens, sched.num_prefill_forwards
            steps0 = sched.num_decode_forwards
            reqs, seconds = submit_and_wait(sched, batch, lengths)
            computed = sched.num_prefill_tokens - pre0
            tokens = sum(len(r.output_ids) for r in reqs)
            out[arm] = {"prefill_tokens": computed,
                        "prefill_ratio": computed / out["unique_prompt_tokens"],
                        "cached_tokens": sum(r.cached_tokens for r in reqs),
                        "prefill_forwards": sched.num_prefill_forwards - fw0,
                        "decode_steps": sched.num_decode_forwards - steps0,
                        "seconds": seconds, "output_tokens": tokens,
                        "output_tokens_per_s": tokens / seconds,
                        "mean_ttft_s": statistics.mean(r.t_first_token - r.t_arrival
                                                       for r in reqs)}
        finally:
            sched.stop()
            runner.release()
        del runner, sched
        if device == "cuda":
            torch.cuda.empty_cache()
        a = out[arm]
        print(f"GRPO {prompts}x{samples} {arm:16}: prefill {a['prefill_tokens']} tokens "
              f"({a['prefill_ratio']:.3f}x unique), {a['seconds']:.2f} s, "
              f"{a['output_tokens_per_s']:.0f} output tok/s", flush=True)
    return out


def sender_tensors(model_dir: Path, device: str) -> list[tuple[str, torch.Tensor]]:
    """New bf16 values, N(0, 0.02), drawn on `device` for every tensor of the checkpoint."""
    from safetensors import safe_open

    gen = torch.Generator(device=device).manual_seed(1)
    named = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sorted(sf.keys()):
                shape = sf.get_slice(name).get_shape()
                named.append((name, torch.empty(shape, dtype=torch.bfloat16, device=device)
                              .normal_(0, 0.02, generator=gen)))
    return named


async def _send(url: str, named: list[tuple[str, torch.Tensor]], *, device: str,
                bucket_bytes: int, version: str) -> dict:
    """One sync through the HTTP route, timed from the buffer's allocation to the last answer."""
    from rltool.delta import tensor_sync
    from rltool.engine import api
    from rltool.rollout.client import EngineClient

    async with EngineClient(url, timeout_s=600) as client:
        t0 = time.perf_counter()
        groups = tensor_sync.buckets(named, bucket_bytes=bucket_bytes)
        size = tensor_sync.segment_bytes(named, bucket_bytes=bucket_bytes)
        buffer, fmt = ((tensor_sync.CudaIpcBuffer(size, device=device), api.CUDA_IPC_FORMAT)
                       if device == "cuda" else (tensor_sync.ShmSegment(size), api.SHM_FORMAT))
        pack = 0.0
        with buffer as buf:
            for i, bucket in enumerate(groups):
                tp = time.perf_counter()
                message = json.dumps(buf.write(bucket))
                pack += time.perf_counter() - tp
                answer = await client.update_weights_from_tensor(
                    [message], load_format=fmt,
                    weight_version=version if i == len(groups) - 1 else None)
                assert answer["success"], answer
        seconds = time.perf_counter() - t0
        info = await client.get_server_info()
    assert info["weight_version"] == version, info["weight_version"]
    return {"seconds": seconds, "sender_pack_s": pack, "buckets": len(groups)}


def tensor_sync_timing(model_dir: Path, *, device: str, bucket_bytes: int) -> dict:
    from rltool.rollout.launch import start_engine

    named = sender_tensors(model_dir, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    out: dict = {"bytes": nbytes, "tensors": len(named), "bucket_bytes": bucket_bytes,
                 "transport": "cuda_ipc" if device == "cuda" else "shm"}
    proc = start_engine(["--engine", "builtin", "--device", device, "--dtype", "bf16",
                         "--model", str(model_dir), "--max-running-requests", "4",
                         "--cuda-graph-max-bs", "4", "--mem-fraction-static", "0.5",
                         "--log-level", "warning"],
                        log_path=Path(tempfile.mkdtemp()) / "serve.log", ready_timeout_s=600)
    try:
        runs = [asyncio.run(_send(proc.url, named, device=device, bucket_bytes=bucket_bytes,
                                  version=f"sync-{i}")) for i in range(REPEATS)]
    finally:
        proc.stop()
    out["http_runs"] = runs
    out["http_seconds"] = statistics.median(r["seconds"] for r in runs)
    out["http_GBps"] = nbytes / out["http_seconds"] / 1e9
    runner = PagedRunner(model_dir, device=device, dtype="bf16", max_running=4,
                         max_total_tokens=4096, disable_cuda_graph=True)
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        runner.load_named_tensors(named)  # waits for the device's copies before returning
        times.append(time.perf_counter() - t0)
    runner.release()
    del runner, named
    if device == "cuda":
        torch.cuda.empty_cache()
    out["in_process_runs_s"] = times
    out["in_process_seconds"] = statistics.median(times)
    out["in_process_GBps"] = nbytes / out["in_process_seconds"] / 1e9
    print(f"tensor sync {nbytes / 1e9:.3g} GB in {runs[0]['buckets']} buckets of "
          f"{bucket_bytes / 2**20:.3g} MiB ({out['transport']}): HTTP {out['http_seconds']:.3f} s "
          f"({out['http_GBps']:.3g} GB/s), in process {out['in_process_seconds']:.3f} s "
          f"({out['in_process_GBps']:.3g} GB/s)", flush=True)
    return out
