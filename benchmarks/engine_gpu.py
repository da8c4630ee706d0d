"""Benchmark the paged CUDA engine on one GPU against transformers `generate` and the roofline.

One script, one mode per run (`--mode`, default throughput):
  throughput          workload (a) below, in process and over HTTP, beside `generate` and the
                      roofline
  deterministic-cost  workload (a) in process with `--deterministic` (batch-invariant kernels,
                      logprobs recomputed per finished request) against the default mode on the
                      same engine settings: tokens/s of each and their ratio (also
                      `--deterministic-cost`)
  fp8                 workload (a) in process with the checkpoint's bf16 weights, its block-FP8
                      version and FP8 weights plus an FP8 KV cache, and the GEMM rates (also
                      `--precision fp8`; benchmarks/engine_fp8.py says how)
  fp8-quick           the GEMM rates and the fused quantization kernels of `--preset`, then the
                      bf16 and fp8 engines (`--gemm-only`, `--engines-only`)
  int4                workload (a) on bf16, block-FP8 and INT4 weights of the qwen2 `--preset`
                      (B = 1, 64) and of a qwen3_moe model of `--moe-preset`'s shapes
                      (`--moe-batches`, default 64), one table; the INT4 GEMM rates against bf16
                      (`--gemm-only`, `--engines-only`; benchmarks/engine_int4.py says how)
  rl                  workload (b), GRPO-shaped, with and without the prefix cache, and the
                      in-memory weight sync through /update_weights_from_tensor (`--grpo
                      PRESETS`, `--tensor-sync PRESETS`; benchmarks/engine_rl.py says how); with
                      `--device cpu` (the tiny preset, shared memory in place of CUDA IPC) on a
                      machine without a GPU
  first-batches       a fresh engine's first batches, bf16 and block-FP8 weights of `--preset`:
                      the warm-up, then each batch size `--repeats` times with new prompts; per
                      run its seconds, tokens/s, time to first token and the kernel variants
                      Triton compiled during it (a compile stalls the engine for about a second;
                      once warm a run should compile nothing); `--profile-first`: each batch
                      size's first run under torch.profiler (device idle gaps and the kernel
                      after each, synchronizing calls)
  long-context        decode at 16k and 32k tokens per sequence, B = 8 and 32 (7B: 8 and 16),
                      beside the bytes roofline (benchmarks/engine_long.py says how); `--device
                      cpu --quick`: the tiny preset's smoke rows

Workloads (random-init models with real shapes, bf16; random prompt ids; sampling at temperature
1.0; every request exactly 256 output tokens with ignore_eos):
  (a) B = 64 and 256 concurrent requests of 128-token prompts: output tokens per second, in
      process (the scheduler driven directly) and over HTTP (`rltool serve --device cuda`, B
      concurrent /generate calls, then the same number of prompts as one batched call);
  (c) time to first token at batch 1 (prefill + first sample), in process.
Warm-ups never use the timed prompts: each in-process engine first runs every batch size once,
untimed, on other prompts (`warm_up`); over HTTP the warm-up is B short calls on prompts of the
timed shapes with other token ids, and the concurrent and batched runs have prompts of their
own, so the prefix cache serves no timed prompt. Each in-process run also reports its decode and
prefill forwards, retractions, the CUDA caching allocator's retries and the kernel variants
Triton compiled during it (`kernels_compiled`: 0 once warm).
`--num-continuous-decode-steps 1,8` runs workload (a) in process once per value (decode steps
run back to back per scheduler iteration; the first value is the one the table's main columns
show, every value gets a row of its own); the HTTP run serves with the last one.
Beside it, in the same run: `generate` naive (dynamic cache) and at its best measured here (static
cache; `--hf-compile` adds torch.compile), and the workload's roofline: the sum over its prefill
and decode steps of max(bytes moved / measured copy bandwidth, FLOPs / 989 TFLOP/s).

What limits each figure: per decode step at B, the GPU time of one graph replay (CUDA events),
the sampling time, and the scheduler's wall time per step (the rest is host work); a short torch
profiler trace of the steady state lists the top kernels.

`--sampling plain,filtered` runs workload (a) once more per sampling arm on the first value's
engine (benchmarks/engine_sampling.py), with the overlapped decode blocks each arm launched.

Usage: python -m benchmarks.engine_gpu [--presets qwen2.5-0.5b,qwen2.5-7b] [--batches 64,256]
       [--quick] [--skip-http] [--hf-compile] [--num-continuous-decode-steps 1,8]
       [--sampling plain,filtered] [--out DIR]
       python -m benchmarks.engine_gpu --mode deterministic-cost|fp8 [--presets ...] [--out DIR]
       python -m benchmarks.engine_gpu --mode fp8-quick [--preset qwen2.5-7b]
       [--gemm-only | --engines-only] [--out DIR]
       python -m benchmarks.engine_gpu --mode int4 [--preset qwen2.5-7b]
       [--moe-preset qwen2.5-3b] [--batches 1,64] [--moe-batches 64]
       [--gemm-only | --engines-only] [--out DIR]
       python -m benchmarks.engine_gpu --mode rl [--grpo qwen2.5-0.5b]
       [--tensor-sync qwen2.5-0.5b,qwen2.5-7b] [--bucket-mib 512] [--device cuda|cpu]
       [--grpo-prompts 64 --grpo-samples 8 --grpo-prompt-len 512 --grpo-max-output 2048]
       python -m benchmarks.engine_gpu --mode first-batches [--preset qwen2.5-7b]
       [--batches 64,256] [--repeats 3] [--profile-first] [--out DIR]
       python -m benchmarks.engine_gpu --mode long-context
       [--presets qwen2.5-0.5b,qwen2.5-3b,qwen2.5-7b] [--device cpu --quick] [--out DIR]
`--out DIR` writes DIR/engine_gpu[-MODE]-DATE-DEVICE.json. Prints a table and, last, one JSON
line.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.sampling import SamplingParams

from benchmarks import harness
from benchmarks.engine_common import (OUTPUT_LEN, PROMPT_LEN, checkpoints, copy_bandwidth,
                                      first_batches, in_process, prompts_for, random_checkpoint,
                                      run_batch, warm_up)
from benchmarks.engine_fp8 import precision_cost, quick
from benchmarks.engine_int4 import int4_mode
from benchmarks.engine_long import long_context
from benchmarks.engine_rl import grpo_workload, tensor_sync_timing
from benchmarks.engine_sampling import parse_arms, print_table, sampler_alone, sampling_runs
from benchmarks.workloads import hf_generate
PEAK_BF16 = 989e12


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


def step_breakdown(runner: PagedRunner, batch: int) -> dict:
    """GPU time of one decode graph replay and of sampling at `batch`, by CUDA events."""
    from rltool.engine.batch_sampling import sample_batch

    rids = [f"prof{i}" for i in range(batch)]
    runner.prefill([(r, list(range(1, PROMPT_LEN + 1)), 0) for r in rids], want=[False] * batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        logits = runner.decode(rids, [1] * batch)
    harness.sync()
    t0 = time.perf_counter()
    start.record()
    for _ in range(20):
        logits = runner.decode(rids, [1] * batch)
    end.record()
    harness.sync()
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
        harness.sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    for r in rids:
        runner.remove(r)
    return {"decode_graph_gpu_s": decode_gpu, "decode_call_wall_s": decode_wall,
            "sampling_wall_s": sample_wall, "profile_top": table}


def hf_baseline(model_dir: Path, batch: int, vocab: int, *, mode: str, compile_: bool) -> dict:
    """transformers `generate` on workload (a) at `batch` (sampled, exactly OUTPUT_LEN tokens),
    after a short untimed call, and its time to first token at batch 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda()
    model.eval()
    prompts = prompts_for(batch, vocab, 7)
    kw = dict(min_new_tokens=OUTPUT_LEN, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    if mode == "static":
        kw["cache_implementation"] = "static"
        if not compile_:
            kw["disable_compile"] = True
    hf_generate(model, [p[:16] for p in prompts], max_new_tokens=4, pad_token_id=0,
                **{**kw, "min_new_tokens": 4})
    out, elapsed = hf_generate(model, prompts, max_new_tokens=OUTPUT_LEN, pad_token_id=0, **kw)
    _, ttft = hf_generate(model, prompts[:1], max_new_tokens=1, pad_token_id=0,
                          **{**kw, "min_new_tokens": 1})
    del model
    torch.cuda.empty_cache()
    return {"seconds": elapsed, "tokens_per_s": sum(map(len, out)) / elapsed, "ttft_b1_s": ttft}


async def _http_batch(url: str, warm: list[list[int]], runs: dict[str, list[list[int]]]) -> dict:
    """`warm` as B concurrent short /generate calls, untimed; then `runs["concurrent"]` as B
    concurrent /generate calls (aiohttp: httpx's pool is slow at this concurrency) and
    `runs["batched"]` as one batched /generate call; server-side decode steps from
    /get_server_info. The three prompt sets have the same shapes and different token ids, so
    the prefix cache serves no timed prompt from an earlier call."""
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

        # Warm-up at full concurrency opens the connections (a rollout client keeps them) and
        # compiles the prefill and decode shapes at B.
        await asyncio.gather(*[post({"input_ids": p, "sampling_params": {**sp,
                                                                         "max_new_tokens": 4}})
                               for p in warm])
        for mode, prompts in runs.items():
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
        return {b: asyncio.run(_http_batch(
            proc.url, prompts_for(b, vocab, 2_000 + b),
            {"concurrent": prompts_for(b, vocab, 11), "batched": prompts_for(b, vocab, 12)}))
            for b in batches}
    finally:
        proc.stop()


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


def parse_batches(args: argparse.Namespace, default: str = "64,256") -> list[int]:
    return [int(b) for b in (args.batches or default).split(",")]


def throughput(args: argparse.Namespace) -> dict:
    """Workload (a): in process per --num-continuous-decode-steps value, the step breakdown,
    over HTTP and transformers `generate` beside the roofline."""
    batches = parse_batches(args)
    multi = [int(n) for n in args.num_continuous_decode_steps.split(",")]
    bw = copy_bandwidth()
    results: dict = {"copy_bandwidth_Bps": bw, "prompt_len": PROMPT_LEN,
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
                if args.sampling:
                    r["sampling"] = sampling_runs(sched, batches, vocab, args.sampling)
            sched.stop()
        for b in batches:
            r["engine"][b] = r["by_decode_steps"][multi[0]][b]
            r["roofline"][b] = roofline(runner.spec, b, bw=bw, weight_bytes=r["weight_bytes"])
        if args.sampling:
            r["sampler_alone_s"] = sampler_alone(batches, vocab, args.sampling)
            print_table(r["sampling"], r["sampler_alone_s"], preset)
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
                        r["hf"][mode][b] = hf_baseline(model_dir, b, vocab, mode=mode,
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
    return results


def rl(args: argparse.Namespace) -> dict:
    """Workload (b) for the --grpo presets, then the tensor sync for the --tensor-sync ones."""
    results: dict = {"grpo": {}, "tensor_sync": {}}
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
    return results


def first_batches_mode(args: argparse.Namespace) -> dict:
    """A fresh engine's first batches, bf16 then block-FP8 weights of --preset."""
    batches = parse_batches(args)
    model_dir, fp8_dir = checkpoints(args.preset)
    return {"preset": args.preset,
            "rows": [row for label, d in (("bf16", model_dir), ("fp8", fp8_dir))
                     for row in first_batches(d, batches, args.repeats, label,
                                              profile_first=args.profile_first)]}


def per_preset(fn) -> Callable[[argparse.Namespace], dict]:
    """A mode that runs `fn(preset, batches)` for each of --presets."""
    def mode(args: argparse.Namespace) -> dict:
        return {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                fn.__name__: {p: fn(p, parse_batches(args)) for p in args.presets.split(",")}}
    return mode


MODES: dict[str, Callable[[argparse.Namespace], dict]] = {
    "throughput": throughput,
    "deterministic-cost": per_preset(deterministic_cost),
    "fp8": per_preset(precision_cost),
    "fp8-quick": lambda args: {"preset": args.preset, **quick(
        args.preset, parse_batches(args), args.gemm_only, args.engines_only)},
    "int4": lambda args: {"preset": args.preset, "moe_preset": args.moe_preset, **int4_mode(
        preset=args.preset, moe_preset=args.moe_preset, batches=parse_batches(args, "1,64"),
        moe_batches=[int(b) for b in args.moe_batches.split(",")], gemm_only=args.gemm_only,
        engines_only=args.engines_only)},
    "rl": rl,
    "first-batches": first_batches_mode,
    "long-context": lambda args: long_context(args.presets.split(","), device=args.device,
                                              quick=args.quick),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=sorted(MODES), default=None,
                    help="what to measure (default throughput; the older flags below pick "
                         "their mode too)")
    ap.add_argument("--presets", default="qwen2.5-0.5b")
    ap.add_argument("--preset", default="qwen2.5-7b", help="fp8-quick, first-batches and int4 "
                    "(int4: the dense model, empty for none)")
    ap.add_argument("--batches", default=None, help="default 64,256 (int4: 1,64)")
    ap.add_argument("--moe-preset", default="qwen2.5-3b", help="int4: the shapes of the qwen3_moe "
                    "model (empty for none)")
    ap.add_argument("--moe-batches", default="64", help="int4: the MoE model's batches")
    ap.add_argument("--quick", action="store_true", help="skip transformers generate; "
                    "long-context: the tiny preset's smoke rows")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--sampling", type=parse_arms, default=[],
                    help="throughput: also run workload (a) per sampling arm, e.g. "
                         "plain,filtered (top_p 0.9, top_k 50; benchmarks/engine_sampling.py)")
    ap.add_argument("--hf-compile", action="store_true")
    ap.add_argument("--engine-only", default="", help="presets measured without HTTP and "
                                                      "transformers (e.g. qwen2.5-7b)")
    ap.add_argument("--deterministic-cost", action="store_true",
                    help="= --mode deterministic-cost")
    ap.add_argument("--precision", choices=["fp8"], default=None, help="= --mode fp8")
    ap.add_argument("--grpo", default="", help="presets: workload (b), GRPO-shaped (mode rl)")
    ap.add_argument("--tensor-sync", default="", help="presets: the weight sync timing (mode rl)")
    ap.add_argument("--bucket-mib", type=float, default=512)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: mode rl only")
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-samples", type=int, default=8)
    ap.add_argument("--grpo-prompt-len", type=int, default=512)
    ap.add_argument("--grpo-max-output", type=int, default=2048)
    ap.add_argument("--num-continuous-decode-steps", default="1",
                    help="comma-separated: one in-process run of workload (a) per value")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--gemm-only", action="store_true",
                      help="fp8-quick, int4: the GEMM rates alone")
    only.add_argument("--engines-only", action="store_true",
                      help="fp8-quick, int4: without the GEMM rates")
    ap.add_argument("--repeats", type=int, default=3, help="first-batches: runs per batch size")
    ap.add_argument("--profile-first", action="store_true",
                    help="first-batches: each batch size's first run under torch.profiler")
    ap.add_argument("--out", default=None, help="directory (or .json file) for the record")
    args = ap.parse_args(argv)
    implied = ("rl" if args.grpo or args.tensor_sync else "fp8" if args.precision
               else "deterministic-cost" if args.deterministic_cost else None)
    if args.mode is not None and implied is not None and implied != args.mode:
        ap.error(f"--mode {args.mode} contradicts the flags of mode {implied}")
    args.mode = args.mode or implied or "throughput"
    if args.mode == "rl" and not (args.grpo or args.tensor_sync):
        ap.error("--mode rl needs --grpo PRESETS and/or --tensor-sync PRESETS")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device is visible; mode rl runs on the CPU with --device cpu")
    if args.device == "cpu" and not (args.mode == "rl" or args.mode == "long-context"
                                     and args.quick):
        ap.error(f"--device cpu runs mode rl and long-context --quick only; mode {args.mode} "
                 "needs a GPU")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    run = harness.Run("engine_gpu", device=args.device)
    fields = MODES[args.mode](args)
    run.finish({"mode": args.mode, **fields}, out=args.out,
               variant="" if args.mode == "throughput" else args.mode)


if __name__ == "__main__":
    main()
