"""A fresh engine's first batches on one GPU: does any batch after the warm-up wait for Triton?

For a bf16 random-init checkpoint of the preset and its block-FP8 version (`rltool convert fp8`),
each on a fresh in-process engine (the settings of benchmarks/engine_gpu.py's workload (a)): the
warm-up (`engine_gpu.warm_up`: every batch size once, 2 output tokens), then each batch size
`--repeats` times with new prompts (128-token prompts, 256 output tokens each). Per run: seconds,
tokens/s, mean and max time to first token, and the kernel variants Triton compiled during the run
(named; a compile stalls the engine for about a second). Once the engine is warm a later run of
the same batch size should compile nothing and take as long as the one before it.

Usage: python benchmarks/engine_first_batches.py [--preset qwen2.5-7b] [--batches 64,256]
       [--repeats 3] [--out FILE.json]
(with benchmarks/ on PYTHONPATH). Prints a line per run and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine_gpu import compiled_kernels, fresh_engine, prompts_for, run_batch, warm_up
from engine_gpu_fp8 import checkpoints


def first_batches(model_dir: Path, batches: list[int], repeats: int, label: str) -> list[dict]:
    """The warm-up, then each batch size `repeats` times, on a fresh engine: a row per run."""
    rows = []
    with fresh_engine(model_dir, batches) as (runner, sched):
        runs = [("warm-up", 0, lambda: warm_up(sched, batches, runner.vocab_size) or {})]
        runs += [(f"B={b} #{i + 1}", b, lambda b=b, i=i: run_batch(
            sched, prompts_for(b, runner.vocab_size, 3 + b + 1000 * i)))
            for b in batches for i in range(repeats)]
        for name, batch, fn in runs:
            before = compiled_kernels()
            result = fn()
            new = sorted(compiled_kernels() - before)
            rows.append({"engine": label, "run": name, "batch": batch, **result,
                         "compiled": new})
            shown = {k: round(v, 3) for k, v in result.items()
                     if k in ("seconds", "tokens_per_s", "mean_ttft_s", "max_ttft_s")}
            print(f"{label:5} {name:12} {shown} compiled {len(new)}: {new}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir, fp8_dir = checkpoints(args.preset)
    rows = [row for label, d in (("bf16", model_dir), ("fp8", fp8_dir))
            for row in first_batches(d, batches, args.repeats, label)]
    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "preset": args.preset, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
