"""One torchrun rank of benchmarks/multi_gpu.py's `megatron` run, and its launcher.

Each rank builds the megatron backend in one layout (TP x PP x EP ranks, one GPU each, NCCL; gloo
on the CPU) over the same model, computes the fp32 logprobs of the seeded samples (the TP1
layout writes them as the reference; the others compare), on CUDA the bf16 logprobs too, then
times train steps on its DP share of the samples. Rank 0 writes the row as JSON. Launched by
`launch_layout` (torchrun over the local GPUs); see benchmarks/multi_gpu.py for the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rltool import atomic

from benchmarks import harness

FP32_BOUND = 1e-5
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "tp2pp2": (2, 2, 1), "ep1": (1, 1, 1),
           "ep2": (1, 1, 2), "ep4": (1, 1, 4)}



def planned_memory_gib(model: Path, layout: str, *, micro_batch_tokens: int) -> float:
    """`rltool plan`'s trainer memory per GPU (weights, gradients, optimizer, activations)."""
    from rltool.profile import models
    from rltool.profile.modelcfg import load_shape

    tp, pp, ep = LAYOUTS[layout]
    mem = models.trainer_memory(load_shape(model), gpus=tp * pp * ep, tp=tp, pp=pp, cp=1, ep=ep,
                                etp=tp, micro_batch_tokens=micro_batch_tokens, recompute="none")
    return sum(mem.values()) / models.GIB


def megatron_rank(args: argparse.Namespace) -> None:
    """One torchrun rank of one layout."""
    from safetensors.torch import load_file, save_file

    from rltool.train.backend import MicroBatch
    from rltool.train.backend import build_backend
    from rltool.train.config import BackendConfig
    from rltool.train.dp_schedule import schedule
    from benchmarks.train_megatron import loss_fn, model_flops
    from benchmarks.workloads import make_samples

    tp, pp, ep = LAYOUTS[args.layout]
    config = json.loads((Path(args.model) / "config.json").read_text())
    samples = make_samples(config["vocab_size"], num=args.samples_per_step,
                           lengths=(args.min_len, args.max_len), seed=0)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    result: dict[str, Any] = {"layout": args.layout, "ranks": tp * pp * ep,
                              "tokens_per_step": sum(map(len, samples))}

    def backend_of(dtype: str, trainable: bool) -> Any:
        return build_backend(args.model, trainable=trainable, options=BackendConfig(
            backend="megatron", dtype=dtype, device=args.device, lr=1e-5,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep))

    def logprobs(backend: Any) -> list[torch.Tensor]:
        batch = MicroBatch(indices=list(range(len(samples))), tokens=samples,
                           response_starts=[1] * len(samples))
        return [t.float() for t in backend.forward_logprobs(batch, temperature=1.0).logprobs]

    cuda = args.device == "cuda"
    train_dtype = "bf16" if cuda else "fp32"
    if cuda:  # a frozen fp32 model for the check, then the bf16 one that trains
        got = logprobs(backend_of("fp32", False))
        gc.collect()
        torch.cuda.empty_cache()
        backend = backend_of(train_dtype, True)
    else:  # the fp32 model that trains gives the check's logprobs too
        backend = backend_of(train_dtype, True)
        got = logprobs(backend)
    if args.ref is None:
        if rank0:
            with atomic.atomic_path(args.reference_out) as tmp:
                save_file({str(i): t.contiguous() for i, t in enumerate(got)}, str(tmp))
        ref = got
    else:
        ref = [load_file(args.ref)[str(i)] for i in range(len(samples))]
    result["fp32_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    if cuda:
        diffs = torch.cat([(a - b).abs() for a, b in zip(logprobs(backend), ref)])
        result.update(bf16_max_abs_diff=float(diffs.max()), bf16_mean_abs_diff=float(diffs.mean()))
    mine = schedule([len(s) for s in samples], dp_size=backend.dp_size,
                    max_tokens_per_microbatch=args.seq_len)[backend.dp_rank]
    mbs = [MicroBatch(indices=mb, tokens=[samples[i] for i in mb], response_starts=[1] * len(mb))
           for mb in mine]
    times = []
    if cuda:  # the peak of the training steps, not of the frozen fp32 model before them
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        backend.train_step(mbs, loss_fn, temperature=1.0)
        harness.sync()
        torch.distributed.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    result.update(train_dtype=train_dtype, step_s=step_s, step_s_all=times,
                  tokens_per_s=result["tokens_per_step"] / step_s)
    if cuda:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["mfu"] = model_flops(config, samples) / step_s / (
            args.peak_tflops * 1e12 * result["ranks"])
    if rank0:
        atomic.write_json(args.result, result)


def launch_layout(args: argparse.Namespace, model: Path, layout: str, work: Path,
                  ref: Path | None) -> dict:
    tp, pp, ep = LAYOUTS[layout]
    result = work / f"{model.name}-{layout}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={tp * pp * ep}", "-m", "benchmarks.multi_gpu_megatron",
           "--model", str(model), "--layout", layout, "--result", str(result),
           "--device", args.device, "--samples", str(args.samples_per_step), "--min-len",
           str(args.min_len), "--max-len", str(args.max_len), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--peak-tflops",
           str(args.peak_tflops)]
    cmd += ["--ref", str(ref)] if ref else ["--reference-out", str(work / f"{model.name}.ref")]
    env = dict(os.environ, OMP_NUM_THREADS="1") if args.device == "cpu" else None
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        return {"layout": layout, "ranks": tp * pp * ep,
                "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(result.read_text())


def add_step_options(p: argparse.ArgumentParser) -> None:
    """The sample and step options shared by multi_gpu.py's runs and the ranks."""
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--samples", dest="samples_per_step", type=int, default=32)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=8192, help="micro-batch token cap")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak of one device (H100/H200 SXM: 989)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--ref")
    parser.add_argument("--reference-out")
    add_step_options(parser)
    megatron_rank(parser.parse_args())


if __name__ == "__main__":
    main()
