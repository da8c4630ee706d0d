"""Training throughput of `--backend megatron` against `--backend torch`, in the same run.

For each model preset (random init, rltool.data.models.PRESETS: qwen2.5-0.5b and qwen2.5-3b by
default) it builds each backend on one device, draws --samples-per-step random samples of
--min-len..--max-len tokens (seeded), plans them with the DP schedule into micro-batches of
<= 4,096 tokens by default and times --steps optimizer steps after --warmup steps (loss: mean
token logprob, the shape of a policy-gradient step). The defaults (16 samples of 512-4,096
tokens, 1 warmup and 3 timed steps, both presets) are sized for about three minutes on one H200.

  megatron  micro-batches of <= --seq-len tokens, each packed into one THD row (bf16 parameters,
            fp32 master weights and Adam moments in megatron's optimizer, --use-distributed-
            optimizer and --recompute as in `rltool train`). Qwen2.5-3B shapes need
            about 56 GiB of weights, fp32 gradient buffer, master weights and moments, plus
            ~15 GiB of bf16 activations per 4,096-token row without recompute: one 141 GiB GPU
            holds them. The row's `gradient_accumulation_fusion` says whether weight gradients
            were added to the fp32 main grads inside their GEMM (on CUDA, when torch can).
  torch     its packed layout on CUDA (padded on the CPU) with micro-batches of <= --torch-seq-len
            tokens (fp32 parameters under bf16 autocast); when a preset runs out of memory
            without activation checkpointing it is retried with it (the row says
            `recompute`: full), unless --torch-recompute-full forces it from the start

  tokens/s     real (unpadded) tokens per second of train_step, median step
  MFU          model FLOPs / step time / --peak-tflops: 6 x (linear-layer parameters, lm_head
               included) per token plus causal attention 12 x layers x q_dim x position per token,
               padding not counted (CUDA only)
  peak memory  torch.cuda.max_memory_allocated over the timed steps (CUDA only; the row also
               records what was allocated before the backend was built, which should be ~0)
  profile      with --profile (default on CUDA) one more step of each backend (of
               --profile-backends) under
               torch.profiler: the operator table in OUT/profile-<preset>-<backend>.txt, and in
               the row the device's busy fraction of the median step, the host gaps (device idle
               between kernels in the profiled step, whose host work the profiler slows; the
               largest with the kernel that follows each), device time per kernel kind, the top
               kernels and host operators, and `limit`: the largest share of the step (device
               idle, i.e. the host, or a kernel kind); `host_syncs`: the calls that made the
               host wait for the device in that step (torch's CUDA sync debug mode), by the
               Python line that made them, so a wait per micro-batch shows with a count of at
               least the micro-batch count
  allocator    `allocator_events`: what the timed steps asked of the CUDA caching allocators
               (cudaMalloc retries and cache flushes, each of which waits for the device; new
               device segments and frees; new pinned host blocks). The script runs with
               PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the environment sets it
               (packed rows of varying length otherwise fragment the cache until a cudaMalloc
               fails and the allocator flushes it, waiting for the device)
  phases       `phase_s`: seconds to build the backend, run the warm-up, the timed steps and the
               profiled step (with its trace summary), printed as they finish
  plan         with --plan, each backend runs the setting rltool.train.memfit picks for the
               device (`--recompute auto`, `--max-tokens-per-microbatch 0`, as `rltool train`
               does), and the row records that choice and the plan's predicted peak beside the
               measured one (`plan.predicted_peak_gib`, `plan.error`: measured / predicted - 1).
               --device-memory-gb caps the plan and, on CUDA, the process
               (torch.cuda.set_per_process_memory_fraction), so a run on a larger card stands
               for the smaller one; --optimizer-cpu-offload, --optimizer-offload-fraction and
               --param-dtype are passed to the backends as in `rltool train`

Results are written after every (preset, backend) to OUT/train_megatron-DATE-DEVICE.json
(atomic), so a run cut short keeps what it measured; a backend that fails (e.g. out of memory)
records its error and the run goes on. Prints a table and, last, one JSON line.

GPU:  python -m benchmarks.train_megatron --device cuda --out benchmarks/results
      (Qwen2.5-3B shapes alone, both backends, about three minutes on one H200:
      --presets qwen2.5-3b)
      (the 7B shapes with megatron on an 80 GB budget, the plan's choice, optimizer offload:
      --presets qwen2.5-7b --backends megatron --plan --device-memory-gb 80
      --use-distributed-optimizer --optimizer-cpu-offload)
CPU (a check of the script itself, minutes):
      python -m benchmarks.train_megatron --device cpu --presets tiny --dtype fp32 --seq-len 64 \\
          --torch-seq-len 64 --min-len 8 --max-len 48 --samples-per-step 8 --steps 2 --warmup 1 \\
          --out /tmp/bench
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

# read when torch first allocates CUDA memory, so set before anything does
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

from rltool.data.models import init_model
from rltool.train.backend import MicroBatch
from rltool.train.backend import build_backend
from rltool.train import memfit
from rltool.train.config import BackendConfig
from rltool.profile.torch_trace import profiled

from benchmarks import harness
from benchmarks.harness import progress
from benchmarks.workloads import make_samples, micro_batches

def model_flops(config: dict, samples: list[list[int]]) -> float:
    """Training FLOPs of one step over `samples` (3 x forward; forward = 2 x MACs; a MoE layer
    counts its top-k experts and its router)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, groups = config["num_attention_heads"], config.get("num_key_value_heads") or \
        config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    router = 0
    if config.get("num_experts"):  # MoE: the active experts' FFN and the router per token
        ffn = config["num_experts_per_tok"] * config["moe_intermediate_size"]
        router = h * config["num_experts"]
    per_layer = h * heads * d + 2 * h * groups * d + heads * d * h + 3 * h * ffn + router
    linear = layers * per_layer + h * vocab
    tokens = sum(len(s) for s in samples)
    positions = sum(len(s) * (len(s) + 1) / 2 for s in samples)
    return 6.0 * linear * tokens + 12.0 * layers * heads * d * positions


def loss_fn(out, mb):
    tokens = sum(lp.numel() for lp in out.logprobs)
    loss = -sum(lp.sum() for lp in out.logprobs) / max(tokens, 1)
    return loss, {"train/loss": loss.detach()}


ALLOC_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc",
                  "num_device_free")


def allocator_counters() -> dict[str, int]:
    """The CUDA caching allocators' cumulative event counters (see `allocator_events`)."""
    stats = torch.cuda.memory_stats()
    out = {name: int(stats.get(name, 0)) for name in ALLOC_COUNTERS}
    if hasattr(torch.cuda, "host_memory_stats"):  # the pinned host allocator, newer torch only
        out["num_host_alloc"] = int(torch.cuda.host_memory_stats().get("num_host_alloc", 0))
    return out


def bench_backend(name: str, model_dir: Path, samples: list[list[int]], args: argparse.Namespace,
                  out_dir: Path, preset: str, *, recompute: bool = False) -> dict:
    common = dict(backend=name, dtype=args.dtype, device=args.device, lr=1e-5,
                  device_memory_gb=args.device_memory_gb,
                  optimizer_cpu_offload=args.optimizer_cpu_offload,
                  optimizer_offload_fraction=args.optimizer_offload_fraction)
    if name == "megatron":
        options = BackendConfig(**common, recompute="auto" if args.plan else args.recompute,
                                use_distributed_optimizer=args.use_distributed_optimizer)
        cap = args.seq_len
    else:
        options = BackendConfig(**common, param_dtype=args.param_dtype,
                                micro_batch_layout="packed" if args.device == "cuda" else "padded",
                                recompute="auto" if args.plan else "full" if recompute else "none")
        cap = args.torch_seq_len
    predict = None
    if args.plan:
        options, predict = plan_options(options, model_dir, samples)
        cap = options.max_tokens_per_microbatch
    cuda = torch.cuda.is_available()
    # what an earlier backend of the run left allocated (its memory should be gone)
    before = torch.cuda.memory_allocated() / 2**30 if cuda else None
    phases: dict[str, float] = {}
    start = time.perf_counter()
    backend = build_backend(model_dir, options=options)
    phases["build"] = time.perf_counter() - start
    progress(f"{preset} {name}: built in {phases['build']:.1f} s")
    mbs = micro_batches(samples, cap=cap, response_starts=[1] * len(samples))  # all trained
    planned = None
    if predict is not None:  # the plan's peak for the largest micro-batch this step runs
        largest = max(sum(map(len, mb.tokens)) for mb in mbs)
        budget = memfit.device_bytes(options)
        planned = {"recompute": options.recompute, "max_tokens_per_microbatch": cap,
                   "logprob_chunk_tokens": options.logprob_chunk_tokens,
                   "largest_micro_batch_tokens": largest,
                   "predicted_peak_gib": predict(options.recompute, largest,
                                                 options.logprob_chunk_tokens) / 2**30,
                   "device_budget_gib": budget / 2**30 if budget else None}
    try:
        start = time.perf_counter()
        for _ in range(args.warmup):
            backend.train_step(mbs, loss_fn, temperature=1.0)
        harness.sync()
        phases["warmup"] = time.perf_counter() - start
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            counters = allocator_counters()
        step = functools.partial(backend.train_step, mbs, loss_fn, temperature=1.0)
        times, _ = harness.timed(step, repeats=args.steps)
        phases["steps"] = sum(times)
        progress(f"{preset} {name}: warm-up {phases['warmup']:.1f} s, steps {times}")
        result = {"backend": name, "step_s": statistics.median(times), "step_s_all": times,
                  "micro_batches": len(mbs), "max_tokens_per_microbatch": cap,
                  "phase_s": phases}
        if name == "torch":
            result["recompute"] = options.recompute
        else:  # weight gradients added to the fp32 main grads inside their GEMM
            result["gradient_accumulation_fusion"] = backend.config.gradient_accumulation_fusion
        if cuda:
            result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            result["allocated_before_gib"] = before
            result["allocator_events"] = {k: v - counters[k]
                                          for k, v in allocator_counters().items()}
        if planned is not None:
            if cuda:
                planned["error"] = result["peak_memory_gib"] / planned["predicted_peak_gib"] - 1
            result["plan"] = planned
        if args.profile and name in args.profile_backends.split(","):
            start = time.perf_counter()
            try:
                result["profile"] = profile_step(backend, mbs,
                                                 out_dir / f"profile-{preset}-{name}.txt",
                                                 result["step_s"])
            except Exception as e:  # noqa: BLE001 - the timings above stand without a profile
                result["profile"] = {"error": f"{type(e).__name__}: {e}"}
            phases["profile"] = time.perf_counter() - start
            progress(f"{preset} {name}: profiled in {phases['profile']:.1f} s")
        return result
    finally:
        del backend
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def plan_options(options: BackendConfig, model_dir: Path, samples: list[list[int]]
                 ) -> tuple[BackendConfig, memfit.Predict]:
    """`options` with recompute, micro-batch cap and logprob chunk as the memory plan picks them
    for the device (rltool.train.memfit.fit, as `rltool train` runs it), and the plan's
    predictor of device bytes."""
    auto = options.model_copy(update={"max_tokens_per_microbatch": 0})
    options = options.model_copy(update=memfit.fit(auto, model_dir,
                                                   longest=max(map(len, samples)), world_size=1))
    return options, memfit.predictor(options, memfit.read_hf_config(model_dir), world_size=1)


def best_run(name: str, model_dir: Path, samples: list[list[int]], args: argparse.Namespace,
             out_dir: Path, preset: str) -> dict:
    """bench_backend; the torch backend again with activation checkpointing when it ran out of
    memory without (retried after the failed run's memory is released)."""
    try:
        return bench_backend(name, model_dir, samples, args, out_dir, preset,
                             recompute=args.torch_recompute_full)
    except torch.OutOfMemoryError:
        if name != "torch" or args.torch_recompute_full or args.plan:
            raise
    gc.collect()  # the failed run's frames are gone with the handled exception
    torch.cuda.empty_cache()
    return bench_backend(name, model_dir, samples, args, out_dir, preset, recompute=True)


def profile_step(backend, mbs: list[MicroBatch], path: Path, step_s: float) -> dict:
    """One more step under torch.profiler (rltool.profile.torch_trace.profiled): its operator
    table to `path`; on CUDA the device's share against the unprofiled median step `step_s`."""
    summary = profiled(lambda: backend.train_step(mbs, loss_fn, temperature=1.0), step_s,
                       table=path)
    summary["profiled_step_s"] = summary.pop("profiled_s")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-3b")
    parser.add_argument("--backends", default="megatron,torch")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--seq-len", type=int, default=4096,
                        help="megatron: micro-batch token cap (one packed row)")
    parser.add_argument("--torch-seq-len", type=int, default=4096,
                        help="torch: micro-batch token cap (benchmarks/train_gpu.py runs 16384)")
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--samples-per-step", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--recompute", choices=("none", "selective", "full", "auto"),
                        default="none",
                        help="megatron: activation recomputation, as `rltool train --recompute`")
    parser.add_argument("--plan", action="store_true",
                        help="both backends: recompute and micro-batch cap as the memory plan "
                        "picks them (`--recompute auto --max-tokens-per-microbatch 0`)")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="the plan's device budget in GB; on CUDA the process is capped to it")
    parser.add_argument("--optimizer-cpu-offload", action="store_true",
                        help="as `rltool train --optimizer-cpu-offload` (megatron: needs "
                        "--use-distributed-optimizer)")
    parser.add_argument("--optimizer-offload-fraction", type=float, default=1.0)
    parser.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="torch: as `rltool train --param-dtype`")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--torch-recompute-full", action="store_true",
                        help="torch: activation checkpointing from the start (default: only "
                        "after running out of memory without it)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of one device (H100/H200 SXM: 989)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--profile-backends", default="megatron,torch",
                        help="the backends that get the profiled step (with --profile)")
    parser.add_argument("--out", required=True, help="directory for the results JSON")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible; use --device cpu")
    if args.device == "cpu" and torch.cuda.is_available():
        parser.error("--device cpu on a machine with CUDA: the megatron backend uses the GPUs "
                     "when they are visible; hide them (CUDA_VISIBLE_DEVICES=) or use cuda")
    if args.profile is None:
        args.profile = args.device == "cuda"
    if args.device_memory_gb is not None and args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.device_memory_gb * 1e9 / total))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    import megatron.core

    run = harness.Run("train_megatron", device=args.device)
    record = {"megatron_core": megatron.core.__version__, "args": vars(args),
              "alloc_conf": os.environ["PYTORCH_CUDA_ALLOC_CONF"], "results": []}
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            model_dir = init_model(Path(tmp) / preset, preset=preset, seed=0,
                                   dtype="bf16" if args.dtype == "bf16" else "fp32",
                                   device=args.device)
            progress(f"{preset}: random weights written")
            config = json.loads((model_dir / "config.json").read_text())
            samples = make_samples(config["vocab_size"], num=args.samples_per_step,
                                   lengths=(args.min_len, args.max_len), seed=0)
            flops = model_flops(config, samples)
            tokens = sum(len(s) for s in samples)
            for name in args.backends.split(","):
                row = {"preset": preset, "tokens_per_step": tokens, "flops_per_step": flops}
                try:
                    row.update(best_run(name, model_dir, samples, args, out_dir, preset))
                    row["tokens_per_s"] = tokens / row["step_s"]
                    if cuda:
                        row["mfu"] = flops / row["step_s"] / (args.peak_tflops * 1e12)
                except Exception as e:  # noqa: BLE001 - recorded, the next backend still runs
                    row.update(backend=name, error=f"{type(e).__name__}: {e}",
                               traceback=traceback.format_exc()[-2000:])
                record["results"].append(row)
                run.write(run.record(record), out_dir)  # a run cut short keeps what it measured
                progress(json.dumps({k: v for k, v in row.items() if k != "traceback"}))
    print(f"{'preset':14s} {'backend':9s} {'tokens':>7s} {'step s':>8s} {'tokens/s':>10s} "
          f"{'MFU':>6s} {'peak GiB':>9s} {'busy':>5s}  limit")
    for r in record["results"]:
        if "error" in r:
            print(f"{r['preset']:14s} {r['backend']:9s} error: {r['error'][:80]}")
            continue
        mfu = f"{r['mfu']:6.1%}" if "mfu" in r else "     -"
        mem = f"{r['peak_memory_gib']:9.1f}" if "peak_memory_gib" in r else "        -"
        prof = r.get("profile", {})
        busy = f"{prof['gpu_busy_fraction']:5.0%}" if "gpu_busy_fraction" in prof else "    -"
        print(f"{r['preset']:14s} {r['backend']:9s} {r['tokens_per_step']:7d} {r['step_s']:8.3f} "
              f"{r['tokens_per_s']:10.0f} {mfu} {mem} {busy}  {prof.get('limit', '-')}")
    for r in record["results"]:
        prof = r.get("profile", {})
        if "host_syncs" in prof:
            sites = ", ".join(f"{s['at']} x{s['calls']}" for s in prof["host_syncs"]["sites"][:4])
            print(f"{r['preset']} {r['backend']}: limit {prof['limit']}; host syncs in the "
                  f"profiled step {prof['host_syncs']['count']} over {r['micro_batches']} "
                  f"micro-batches ({sites or 'none'}); allocator {r.get('allocator_events')}")
    run.finish(record, out=out_dir)


if __name__ == "__main__":
    main()
