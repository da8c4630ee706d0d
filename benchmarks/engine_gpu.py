"""Benchmark the paged CUDA engine on one GPU against transformers `generate` and the roofline.

Workloads (random-init models with real shapes, bf16; random prompt ids; sampling at temperature
1.0; every request exactly 256 output tokens with ignore_eos):
  (a) B = 64 and 256 concurrent requests of 128-token prompts: output tokens per second, in
      process (the scheduler driven directly) and over HTTP (`rltool serve --device cuda`, B
      concurrent /generate calls);
  (c) time to first token at batch 1 (prefill + first sample), in process.
Each in-process engine first runs every batch size once, untimed (`warm_up`). Each in-process
run also reports its decode and prefill forwards, retractions, the CUDA caching allocator's
retries and the kernel variants Triton compiled during it (`kernels_compiled`: 0 once warm).
`--deterministic-cost` measures instead workload (a) in process with `--deterministic`
(batch-invariant kernels, logprobs recomputed per finished request) against the default mode on
the same engine settings: tokens/s of each and their ratio.
`--grpo PRESETS` and `--tensor-sync PRESETS` measure instead workload (b), GRPO-shaped, with and
without the prefix cache, and the in-memory weight sync through /update_weights_from_tensor
(benchmarks/engine_gpu_rl.py says how); with `--device cpu` (the tiny preset, shared memory in
place of CUDA IPC) they run on a machine without a GPU.
`--num-continuous-decode-steps 1,8` runs workload (a) in process once per value (decode steps
run back to back per scheduler iteration; the first value is the one the table's main columns
show, every value gets a row of its own); the HTTP run serves with the last one.
Beside it, in the same run: `generate` naive (dynamic cache) and at its best measured here (static
cache; `--hf-compile` adds torch.compile), and the workload's roofline: the sum over its prefill
and decode steps of max(bytes moved / measured copy bandwidth, FLOPs / 989 TFLOP/s).

What limits each figure: per decode step at B, the GPU time of one graph replay (CUDA events),
the sampling time, and the scheduler's wall time per step (the rest is host work); a short torch
profiler trace of the steady state lists the top kernels.

`--precision fp8` measures instead workload (a) in process with the checkpoint's bf16 weights,
with its block-FP8 version and with FP8 weights plus an FP8 KV cache (benchmarks/engine_gpu_fp8.py
says how).

Usage: python benchmarks/engine_gpu.py [--presets qwen2.5-0.5b,qwen2.5-7b] [--batches 64,256]
       [--quick] [--skip-http] [--hf-compile] [--deterministic-cost] [--precision fp8]
       [--num-continuous-decode-steps 1,8] [--out FILE.json]
       python benchmarks/engine_gpu.py [--grpo qwen2.5-0.5b] [--tensor-sync qwen2.5-0.5b,qwen2.5-7b]
       [--bucket-mib 512] [--device cuda|cpu] [--grpo-prompts 64 --grpo-samples 8
       --grpo-prompt-len 512 --grpo-max-output 2048] [--out FILE.json]
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams

PROMPT_LEN = 128
OUTPUT_LEN = 256
PEAK_BF16 = 989e12


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (4 GiB buffers)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * a.numel() * 10 / (start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return bw


def roofline(spec, batch: int, *, bw: float, weight_bytes: int) -> dict:
    """Seconds of the workload's prefill and decode steps at the roofline (bf16 everywhere).
    Bytes: weights read once per forward (the embedding table only for the rows looked up), KV
    read and written, logits written once; FLOPs: matmuls (2 per weight per token) + attention."""
    layers, hd = spec.num_layers, spec.head_dim
    kv_tok = spec.kv_bytes_per_token * 2
    head = spec.vocab_size * spec.hidden_size
    params = weight_bytes / 2
    body = params - head - (0 if spec.tie_word_embeddings else head)  # matmul weights, no head
    read = weight_bytes - (0 if spec.tie_word_embeddings else 2 * head)
    attn = lambda q, ctx: 4 * q * ctx * layers * spec.num_heads * hd
    T = batch * PROMPT_LEN
    pre_flops = 2 * body * T + attn(T, PROMPT_LEN / 2) + 2 * head * batch
    pre_bytes = read + T * kv_tok + batch * spec.vocab_size * 2
    total = max(pre_bytes / bw, pre_flops / PEAK_BF16)
    for step in range(OUTPUT_LEN - 1):
        ctx = PROMPT_LEN + step + 1
        flops = 2 * (body + head) * batch + attn(batch, ctx)
        bytes_ = read + batch * ctx * kv_tok + batch * spec.vocab_size * 2
        total += max(bytes_ / bw, flops / PEAK_BF16)
    return {"seconds": total, "tokens_per_s": batch * OUTPUT_LEN / total}


def random_checkpoint(out: Path, preset: str, device: str = "cuda") -> Path:
    """A random-init bf16 checkpoint of the preset's shapes (`rltool init-model`), drawn on
    `device`: on the GPU a 7B model takes seconds, not the minutes of the CPU init."""
    from rltool.data.models import init_model

    return init_model(out, preset=preset, dtype="bf16", device=device)


def prompts_for(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)] for _ in range(n)]


def run_batch(sched: PagedScheduler, prompts, *, max_new: int = OUTPUT_LEN) -> dict:
    done, finished = threading.Event(), []

    def on_finish(req):
        finished.append(req)
        if len(finished) == len(prompts):
            done.set()

    tag = sched.next_seq()
    reqs = [Request(rid=f"b{tag}-{i}", prompt_ids=p, on_finish=on_finish, return_logprob=True,
                    params=SamplingParams(max_new_tokens=max_new, temperature=1.0,
                                          ignore_eos=True))
            for i, p in enumerate(prompts)]
    counters0 = _counters(sched)
    t0 = time.perf_counter()
    sched.submit(reqs)
    assert done.wait(600), "engine run did not finish"
    elapsed = time.perf_counter() - t0
    out = sum(len(r.output_ids) for r in reqs)
    assert all(len(r.output_ids) == max_new for r in reqs)
    ttfts = [r.t_first_token - r.t_arrival for r in reqs]
    counts = {k: v - counters0[k] for k, v in _counters(sched).items()}
    return {"seconds": elapsed, "output_tokens": out, "tokens_per_s": out / elapsed,
            "mean_ttft_s": statistics.mean(ttfts), "max_ttft_s": max(ttfts), **counts}


def _counters(sched: PagedScheduler) -> dict:
    """What a run adds to: the scheduler's decode and prefill forwards and retractions, the CUDA
    caching allocator's retries (a cudaMalloc that failed, so the cache was freed and the
    allocation tried again: a stall of the whole device), and the kernel variants in Triton's
    cache directory (each compile writes one; a compile stalls the engine for ~1 s)."""
    retries = (torch.cuda.memory_stats().get("num_alloc_retries", 0)
               if torch.cuda.is_available() else 0)
    return {"decode_steps": sched.num_decode_forwards,
            "prefill_forwards": sched.num_prefill_forwards,
            "retractions": sched.num_retractions, "alloc_retries": retries,
            "kernels_compiled": len(compiled_kernels())}


def compiled_kernels() -> set[str]:
    """The kernel variants in Triton's cache directory: "name@hash" of each."""
    import triton

    root = Path(triton.knobs.cache.dir)
    return {f"{meta.stem}@{meta.parent.name[:6]}" for meta in root.glob("*/*.json")
            if not meta.name.startswith("__grp__")}


def step_breakdown(runner: PagedRunner, batch: int) -> dict:
    """GPU time of one decode graph replay and of sampling at `batch`, by CUDA events."""
    from rltool.engine.batch_sampling import sample_batch

    rids = [f"prof{i}" for i in range(batch)]
    runner.prefill([(r, list(range(1, PROMPT_LEN + 1)), 0) for r in rids], want=[False] * batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        logits = runner.decode(rids, [1] * batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    for _ in range(20):
        logits = runner.decode(rids, [1] * batch)
    end.record()
    torch.cuda.synchronize()
    decode_gpu = start.elapsed_time(end) / 20 / 1e3
    decode_wall = (time.perf_counter() - t0) / 20
    params = [SamplingParams(temperature=1.0)] * batch
    kw = dict(generators=[None] * batch, suppressed=[[]] * batch, top_n=[0] * batch,
              token_ids=[None] * batch, seeds=list(range(batch)), use_kernel=True)
    sample_batch(logits, params, **kw)
    t0 = time.perf_counter()
    for _ in range(20):
        sample_batch(logits, params, **kw)
    sample_wall = (time.perf_counter() - t0) / 20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            sample_batch(runner.decode(rids, [1] * batch), params, **kw)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    for r in rids:
        runner.remove(r)
    return {"decode_graph_gpu_s": decode_gpu, "decode_call_wall_s": decode_wall,
            "sampling_wall_s": sample_wall, "profile_top": table}


def hf_generate(model_dir: Path, batch: int, vocab: int, *, mode: str, compile_: bool) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda()
    model.eval()
    ids = torch.tensor(prompts_for(batch, vocab, 7), device="cuda")
    kw = dict(max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=True,
              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    if mode == "static":
        kw["cache_implementation"] = "static"
        if not compile_:
            kw["disable_compile"] = True
    with torch.no_grad():
        model.generate(ids[:, :16], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        n = (out.shape[1] - PROMPT_LEN) * batch
        one = ids[:1]
        t1 = time.perf_counter()
        model.generate(one, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
        torch.cuda.synchronize()
        ttft = time.perf_counter() - t1
    del model
    torch.cuda.empty_cache()
    return {"seconds": elapsed, "tokens_per_s": n / elapsed, "ttft_b1_s": ttft}


async def _http_batch(url: str, prompts) -> dict:
    """B concurrent /generate calls (aiohttp: httpx's pool is slow at this concurrency), then the
    same prompts as one batched /generate call; server-side decode steps from /get_server_info."""
    import aiohttp

    sp = {"max_new_tokens": OUTPUT_LEN, "temperature": 1.0, "ignore_eos": True}
    out = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def post(body):
            async with s.post(url + "/generate", json=body) as r:
                return await r.json()

        async def steps():
            async with s.get(url + "/get_server_info") as r:
                return (await r.json())["internal_states"][0]["num_decode_forwards"]

        # Warm-up at full concurrency opens the connections (a rollout client keeps them).
        await asyncio.gather(*[post({"input_ids": p, "sampling_params": {**sp,
                                                                         "max_new_tokens": 4}})
                               for p in prompts])
        for mode in ("concurrent", "batched"):
            s0 = await steps()
            t0 = time.perf_counter()
            if mode == "concurrent":
                rs = await asyncio.gather(*[post({"input_ids": p, "sampling_params": sp})
                                            for p in prompts])
            else:
                rs = await post({"input_ids": prompts, "sampling_params": sp})
            elapsed = time.perf_counter() - t0
            n = sum(len(r["output_ids"]) for r in rs)
            out[mode] = {"seconds": elapsed, "output_tokens": n, "tokens_per_s": n / elapsed,
                         "server_decode_steps": await steps() - s0}
    out["tokens_per_s"] = out["concurrent"]["tokens_per_s"]
    return out


def http_runs(model_dir: Path, batches, vocab: int, steps: int) -> dict:
    from rltool.rollout.launch import start_engine

    proc = start_engine(["--engine", "builtin", "--device", "cuda", "--model", str(model_dir),
                         "--max-running-requests", str(max(batches)), "--log-level", "warning",
                         "--num-continuous-decode-steps", str(steps)],
                        log_path=Path(tempfile.mkdtemp()) / "serve.log", ready_timeout_s=300)
    try:
        return {b: asyncio.run(_http_batch(proc.url, prompts_for(b, vocab, 11))) for b in batches}
    finally:
        proc.stop()


def warm_up(sched: PagedScheduler, batches: list[int], vocab: int) -> None:
    """Each batch size's prefill once, untimed, with 2 output tokens and other prompts than the
    timed ones (the prefix cache holds none of those): no timed run compiles kernels for its
    prefill shapes, whichever engine of a process meets them first."""
    for b in batches:
        run_batch(sched, prompts_for(b, vocab, 1_000 + b), max_new=2)


@contextlib.contextmanager
def fresh_engine(model_dir: Path, batches: list[int], *, deterministic: bool = False,
                 kv_cache_dtype: str = "auto"):
    """A fresh in-process engine with workload (a)'s settings, (runner, started scheduler);
    stopped and its memory released on exit."""
    runner = PagedRunner(model_dir, device="cuda", dtype="bf16", max_running=max(batches),
                         cuda_graph_max_bs=max(batches), deterministic=deterministic,
                         kv_cache_dtype=kv_cache_dtype)
    sched = PagedScheduler(runner, max_running=max(batches), max_prefill_tokens=16384,
                           chunked_prefill_size=8192, deterministic=deterministic)
    sched.start()
    try:
        yield runner, sched
    finally:
        sched.stop()
        runner.release()
        del runner, sched
        torch.cuda.empty_cache()


def in_process(model_dir: Path, batches: list[int], *, deterministic: bool = False,
               kv_cache_dtype: str = "auto") -> dict:
    """Workload (a) in process on a fresh engine, after an untimed warm-up of each batch size:
    {batch: run_batch result}, plus what the engine holds under "engine" (weight bytes and
    precision, KV bytes per token, pool tokens)."""
    with fresh_engine(model_dir, batches, deterministic=deterministic,
                      kv_cache_dtype=kv_cache_dtype) as (runner, sched):
        warm_up(sched, batches, runner.vocab_size)
        out: dict = {b: run_batch(sched, prompts_for(b, runner.vocab_size, 3 + b))
                     for b in batches}
        out["engine"] = {"weight_bytes": runner.model.nbytes(), **runner.weight_info,
                         "kv_bytes_per_token": runner.kv_bytes_per_token,
                         "kv_pool_tokens": runner.max_total_num_tokens}
    return out


def deterministic_cost(preset: str, batches: list[int]) -> dict:
    """Workload (a) in process, default mode then deterministic mode (same engine settings)."""
    model_dir = random_checkpoint(Path(tempfile.mkdtemp()) / preset, preset)
    out: dict = {}
    for mode in ("default", "deterministic"):
        out[mode] = in_process(model_dir, batches, deterministic=mode == "deterministic")
    for b in batches:
        ratio = out["deterministic"][b]["tokens_per_s"] / out["default"][b]["tokens_per_s"]
        out.setdefault("ratio", {})[b] = ratio
        print(f"{preset:14} B={b:>4}: default {out['default'][b]['tokens_per_s']:>9.0f} tok/s, "
              f"deterministic {out['deterministic'][b]['tokens_per_s']:>9.0f} tok/s "
              f"({ratio:.2f}x)", flush=True)
    return out


def rl_runs(args: argparse.Namespace) -> None:
    """Workload (b) for the --grpo presets, then the tensor sync for the --tensor-sync ones."""
    from engine_gpu_rl import grpo_workload, tensor_sync_timing

    cuda = args.device == "cuda"
    results: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "device": torch.cuda.get_device_name() if cuda else "cpu",
                     "torch": torch.__version__, "grpo": {}, "tensor_sync": {}}
    dirs: dict[str, Path] = {}

    def model(preset: str) -> Path:
        if preset not in dirs:
            dirs[preset] = random_checkpoint(Path(tempfile.mkdtemp()) / preset, preset,
                                             args.device)
        return dirs[preset]

    for preset in filter(None, args.grpo.split(",")):
        results["grpo"][preset] = grpo_workload(
            model(preset), device=args.device, prompts=args.grpo_prompts,
            samples=args.grpo_samples, prompt_len=args.grpo_prompt_len,
            max_output=args.grpo_max_output)
    for preset in filter(None, args.tensor_sync.split(",")):
        results["tensor_sync"][preset] = tensor_sync_timing(
            model(preset), device=args.device, bucket_bytes=int(args.bucket_mib * 2**20))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, default=str))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="qwen2.5-0.5b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--quick", action="store_true", help="skip transformers generate")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--hf-compile", action="store_true")
    ap.add_argument("--engine-only", default="", help="presets measured without HTTP and "
                                                      "transformers (e.g. qwen2.5-7b)")
    ap.add_argument("--deterministic-cost", action="store_true",
                    help="only workload (a) in process, --deterministic against the default")
    ap.add_argument("--grpo", default="", help="presets: only workload (b), GRPO-shaped")
    ap.add_argument("--tensor-sync", default="", help="presets: only the weight sync timing")
    ap.add_argument("--bucket-mib", type=float, default=512)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="--grpo and --tensor-sync only")
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-samples", type=int, default=8)
    ap.add_argument("--grpo-prompt-len", type=int, default=512)
    ap.add_argument("--grpo-max-output", type=int, default=2048)
    ap.add_argument("--precision", choices=["fp8"], default=None,
                    help="only workload (a) in process: bf16 weights against block-FP8 weights "
                         "(and FP8 weights + FP8 KV), plus the GEMMs' TFLOP/s")
    ap.add_argument("--num-continuous-decode-steps", default="1",
                    help="comma-separated: one in-process run of workload (a) per value")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    multi = [int(n) for n in args.num_continuous_decode_steps.split(",")]
    if args.grpo or args.tensor_sync:
        rl_runs(args)
        return
    if args.deterministic_cost or args.precision:
        key, fn = "deterministic_cost", deterministic_cost
        if args.precision:
            from engine_gpu_fp8 import precision_cost as fn

            key = "precision_cost"
        results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                   key: {p: fn(p, batches) for p in args.presets.split(",")}}
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        print(json.dumps(results, default=str))
        return
    bw = copy_bandwidth()
    results: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "copy_bandwidth_Bps": bw, "prompt_len": PROMPT_LEN,
                     "output_len": OUTPUT_LEN, "models": {}}
    rows = []
    for preset in args.presets.split(","):
        model_dir = random_checkpoint(Path(tempfile.mkdtemp()) / preset, preset)
        runner = PagedRunner(model_dir, device="cuda", dtype="bf16", max_running=max(batches),
                             cuda_graph_max_bs=max(batches))
        vocab = runner.vocab_size
        r: dict = {"weight_bytes": runner.model.nbytes(), "kv_pool_bytes": runner.pool.nbytes(),
                   "engine": {}, "roofline": {}, "breakdown": {}, "by_decode_steps": {}}
        for n in multi:  # one scheduler per value, over the same runner
            runner.flush_prefix_cache()  # every value prefills the same prompts in full
            sched = PagedScheduler(runner, max_running=max(batches), max_prefill_tokens=16384,
                                   chunked_prefill_size=8192, num_continuous_decode_steps=n)
            sched.start()
            warm_up(sched, batches, vocab)
            r["by_decode_steps"][n] = {b: run_batch(sched, prompts_for(b, vocab, 3 + b))
                                       for b in batches}
            if n == multi[0]:
                ttfts = [run_batch(sched, prompts_for(1, vocab, 100 + i), max_new=1)
                         ["mean_ttft_s"] for i in range(8)]
                r["engine_ttft_b1_s"] = statistics.median(ttfts)
            sched.stop()
        for b in batches:
            r["engine"][b] = r["by_decode_steps"][multi[0]][b]
            r["roofline"][b] = roofline(runner.spec, b, bw=bw, weight_bytes=r["weight_bytes"])
        for b in batches:
            bd = step_breakdown(runner, b)
            print(bd.pop("profile_top"), flush=True)
            r["breakdown"][b] = bd
        runner.release()
        del runner, sched
        torch.cuda.empty_cache()
        engine_only = preset in args.engine_only.split(",")
        if not args.skip_http and not engine_only:
            r["http"] = http_runs(model_dir, batches, vocab, multi[-1])
        if not args.quick and not engine_only:
            r["hf"] = {}
            for mode in ("dynamic", "static"):
                r["hf"][mode] = {}
                for b in batches:
                    try:
                        r["hf"][mode][b] = hf_generate(model_dir, b, vocab, mode=mode,
                                                       compile_=args.hf_compile)
                    except Exception as e:  # noqa: BLE001 - recorded, the engine's figures still come out
                        r["hf"][mode][b] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    print("generate", mode, b, r["hf"][mode][b], flush=True)
        results["models"][preset] = r
        for n in multi:
            for b in batches:
                e, roof = r["by_decode_steps"][n][b], r["roofline"][b]
                main_row = n == multi[0]
                rows.append((preset, n, b, e["tokens_per_s"],
                             r.get("http", {}).get(b, {}).get("tokens_per_s")
                             if n == multi[-1] else None,
                             r.get("hf", {}).get("dynamic", {}).get(b, {}).get("tokens_per_s")
                             if main_row else None,
                             r.get("hf", {}).get("static", {}).get(b, {}).get("tokens_per_s")
                             if main_row else None,
                             roof["tokens_per_s"], e["tokens_per_s"] / roof["tokens_per_s"],
                             r["breakdown"][b]["decode_graph_gpu_s"] * 1e3,
                             e["seconds"] / max(e["decode_steps"], 1) * 1e3))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'model':14} {'N':>3} {'B':>4} {'engine tok/s':>13} {'http tok/s':>11} {'hf dyn':>9} "
          f"{'hf static':>10} {'roofline':>10} {'of roof':>8} {'gpu ms/step':>12} "
          f"{'wall ms/step':>13}")
    fmt = lambda x, w, p=0: f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"
    for p, n, b, e, h, hd, hs, roof, frac, gpu, wall in rows:
        print(f"{p:14} {n:>3} {b:>4} {fmt(e, 13)} {fmt(h, 11)} {fmt(hd, 9)} {fmt(hs, 10)} "
              f"{fmt(roof, 10)} {frac:>8.1%} {gpu:>12.2f} {wall:>13.2f}")
    for p, r in results["models"].items():
        hf_ttft = min((x["ttft_b1_s"] for mode in r.get("hf", {}).values() for x in mode.values()
                       if "ttft_b1_s" in x), default=None)
        r["hf_ttft_b1_best_s"] = hf_ttft
        for b, h in r.get("http", {}).items():
            print(f"{p} B={b} over HTTP: {h['concurrent']['tokens_per_s']:.0f} tok/s as {b} "
                  f"concurrent requests ({h['concurrent']['server_decode_steps']} server decode "
                  f"steps), {h['batched']['tokens_per_s']:.0f} tok/s as one batched request "
                  f"({h['batched']['server_decode_steps']} steps)")
        print(f"{p}: TTFT at batch 1: engine {r['engine_ttft_b1_s'] * 1e3:.1f} ms, generate "
              f"best {hf_ttft * 1e3 if hf_ttft else float('nan'):.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    sys.exit(main())
