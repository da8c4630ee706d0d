"""Training throughput of `--backend megatron` against `--backend torch`, in the same run.

For each model preset (random init, rltool.data.models.PRESETS: qwen2.5-0.5b and qwen2.5-3b by
default) it builds each backend on one device, draws --samples-per-step random samples of
--min-len..--max-len tokens (seeded), plans them with the DP schedule into micro-batches and times
--steps optimizer steps after --warmup steps (loss: mean token logprob, the shape of a
policy-gradient step). Each backend runs in its best configuration:

  megatron  micro-batches of <= --seq-len tokens, each packed into one THD row (bf16 parameters,
            fp32 master weights in megatron's optimizer)
  torch     its packed layout on CUDA (padded on the CPU) with micro-batches of <= --torch-seq-len
            tokens, as benchmarks/train_gpu.py runs it (fp32 parameters under bf16 autocast);
            when a preset runs out of memory without activation checkpointing it is retried with
            it (the row says `recompute_activations`), unless --torch-recompute-activations forces
            it on from the start

  tokens/s     real (unpadded) tokens per second of train_step, median step
  MFU          model FLOPs / step time / --peak-tflops: 6 x (linear-layer parameters, lm_head
               included) per token plus causal attention 12 x layers x q_dim x position per token,
               padding not counted (CUDA only)
  peak memory  torch.cuda.max_memory_allocated over the timed steps (CUDA only; the row also
               records what was allocated before the backend was built, which should be ~0)

With --profile (default on CUDA) one more megatron step runs under torch.profiler and the top
operators by device time are written to OUT/profile-<preset>-megatron.txt (and the first lines
printed), which names what limits the step.

Results are written after every (preset, backend) to OUT/train_megatron-<date>-<machine>.json
(atomic), so a run cut short keeps what it measured; a backend that fails (e.g. out of memory)
records its error and the run goes on. Prints a table and, last, one JSON line.

GPU:  python benchmarks/train_megatron.py --device cuda --out benchmarks/results
CPU (a check of the script itself, minutes):
      python benchmarks/train_megatron.py --device cpu --presets tiny --dtype fp32 --seq-len 64 \\
          --torch-seq-len 64 --min-len 8 --max-len 48 --samples-per-step 8 --steps 2 --warmup 1 \\
          --out /tmp/bench
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from rltool import atomic
from rltool.data.models import init_model
from rltool.train.backend import MicroBatch
from rltool.train.backends import build_backend
from rltool.train.config import BackendConfig
from rltool.train.dp_schedule import schedule


def make_samples(vocab: int, args: argparse.Namespace, *, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
            for _ in range(args.samples_per_step)]


def micro_batches(samples: list[list[int]], cap: int) -> list[MicroBatch]:
    plan = schedule([len(s) for s in samples], dp_size=1, max_tokens_per_microbatch=cap)[0]
    # response = everything after the first token: every position is trained
    return [MicroBatch(indices=mb, tokens=[samples[i] for i in mb], response_starts=[1] * len(mb))
            for mb in plan]


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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_backend(name: str, model_dir: Path, samples: list[list[int]], args: argparse.Namespace,
                  out_dir: Path, preset: str, *, recompute: bool = False) -> dict:
    if name == "megatron":
        options = BackendConfig(backend=name, dtype=args.dtype, device=args.device, lr=1e-5,
                                recompute_granularity=args.recompute_granularity,
                                use_distributed_optimizer=args.use_distributed_optimizer)
        cap = args.seq_len
    else:
        options = BackendConfig(backend=name, dtype=args.dtype, device=args.device, lr=1e-5,
                                micro_batch_layout="packed" if args.device == "cuda" else "padded",
                                recompute_activations=recompute)
        cap = args.torch_seq_len
    # what an earlier backend of the run left allocated (its memory should be gone)
    before = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
    backend = build_backend(model_dir, options=options)
    mbs = micro_batches(samples, cap)
    try:
        for _ in range(args.warmup):
            backend.train_step(mbs, loss_fn, temperature=1.0)
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            backend.train_step(mbs, loss_fn, temperature=1.0)
            sync()
            times.append(time.perf_counter() - start)
        result = {"backend": name, "step_s": statistics.median(times), "step_s_all": times,
                  "micro_batches": len(mbs), "max_tokens_per_microbatch": cap}
        if name == "torch":
            result["recompute_activations"] = recompute
        if torch.cuda.is_available():
            result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["allocated_before_gib"] = before
        if args.profile and name == "megatron":
            result["profile"] = profile_step(backend, mbs, out_dir / f"profile-{preset}-{name}.txt")
        return result
    finally:
        del backend
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def best_run(name: str, model_dir: Path, samples: list[list[int]], args: argparse.Namespace,
             out_dir: Path, preset: str) -> dict:
    """bench_backend; the torch backend again with activation checkpointing when it ran out of
    memory without (retried after the failed run's memory is released)."""
    try:
        return bench_backend(name, model_dir, samples, args, out_dir, preset,
                             recompute=args.torch_recompute_activations)
    except torch.OutOfMemoryError:
        if name != "torch" or args.torch_recompute_activations:
            raise
    gc.collect()  # the failed run's frames are gone with the handled exception
    torch.cuda.empty_cache()
    return bench_backend(name, model_dir, samples, args, out_dir, preset, recompute=True)


def profile_step(backend, mbs: list[MicroBatch], path: Path) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        backend.train_step(mbs, loss_fn, temperature=1.0)
        sync()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    atomic.write_text(path, table)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-3b")
    parser.add_argument("--backends", default="megatron,torch")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--seq-len", type=int, default=8192,
                        help="megatron: micro-batch token cap (one packed row)")
    parser.add_argument("--torch-seq-len", type=int, default=16384,
                        help="torch: micro-batch token cap (benchmarks/train_gpu.py's)")
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--samples-per-step", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--recompute-granularity", choices=("none", "full", "selective"),
                        default="none")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--torch-recompute-activations", action="store_true",
                        help="torch: activation checkpointing from the start (default: only "
                        "after running out of memory without it)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of one device (H100/H200 SXM: 989)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--out", required=True, help="directory for the results JSON")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible; use --device cpu")
    if args.device == "cpu" and torch.cuda.is_available():
        parser.error("--device cpu on a machine with CUDA: the megatron backend uses the GPUs "
                     "when they are visible; hide them (CUDA_VISIBLE_DEVICES=) or use cuda")
    if args.profile is None:
        args.profile = args.device == "cuda"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    machine = (torch.cuda.get_device_name() if cuda else f"{platform.machine()} "
               f"{os.cpu_count()} cpus")
    stamp = datetime.now(timezone.utc)
    tag = "gpu" if cuda else f"cpu{os.cpu_count()}"
    path = out_dir / f"train_megatron-{stamp:%Y-%m-%d}-{tag}.json"
    import megatron.core

    record = {"benchmark": "train_megatron", "date": stamp.isoformat(), "machine": machine,
              "torch": torch.__version__, "megatron_core": megatron.core.__version__,
              "args": vars(args), "results": []}
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            model_dir = init_model(Path(tmp) / preset, preset=preset, seed=0,
                                   dtype="bf16" if args.dtype == "bf16" else "fp32")
            config = json.loads((model_dir / "config.json").read_text())
            samples = make_samples(config["vocab_size"], args, seed=0)
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
                atomic.write_json(path, record)
                print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    print(f"{'preset':14s} {'backend':9s} {'tokens':>7s} {'step s':>8s} {'tokens/s':>10s} "
          f"{'MFU':>6s} {'peak GiB':>9s}")
    for r in record["results"]:
        if "error" in r:
            print(f"{r['preset']:14s} {r['backend']:9s} error: {r['error'][:80]}")
            continue
        mfu = f"{r['mfu']:6.1%}" if "mfu" in r else "     -"
        mem = f"{r['peak_memory_gib']:9.1f}" if "peak_memory_gib" in r else "        -"
        print(f"{r['preset']:14s} {r['backend']:9s} {r['tokens_per_step']:7d} {r['step_s']:8.3f} "
              f"{r['tokens_per_s']:10.0f} {mfu} {mem}")
    print(f"results: {path}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
