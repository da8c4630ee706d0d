"""The hybrid prefix cache (recurrent-state snapshots, rltool.engine.hybrid_prefix) on workload (b),
GRPO-shaped, against the same engine with --disable-radix-cache, in one run.

Workload (b) as `benchmarks.engine_gpu --mode rl --grpo` runs it (benchmarks/engine_rl.py,
`grpo_workload`): P prompts x S samples of random L-token prompts, seeded lognormal output
lengths capped at --max-output, all submitted at once to the scheduler in process, on a fresh
engine per arm; here on a random-init checkpoint of the qwen3_5 hybrid (Gated DeltaNet and
attention layers) at `--preset`. Per arm: prefill tokens computed against the unique prompt
tokens P x L (the target is <= 1.15x), tokens reused, end-to-end seconds, output tokens/s, mean
time to first token; and the cache arm's ratios over the other.

Usage: python -m benchmarks.engine_hybrid_prefix [--device cuda] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

TARGET_RATIO = 1.15  # prefill tokens over unique prompt tokens, workload (b)'s target
FULL = {"preset": "small", "prompts": 64, "samples": 8, "prompt_len": 512, "max_output": 1024}
QUICK = {"preset": "tiny-4l", "prompts": 4, "samples": 8, "prompt_len": 96, "max_output": 32}


def parse(argv: list[str] | None) -> argparse.Namespace:
    return harness.parse_quick_workload(
        argv, name="engine_hybrid_prefix", doc=__doc__,
        quick_help=f"The smoke workload ({QUICK['prompts']} x {QUICK['samples']}, "
                   f"{QUICK['prompt_len']}-token prompts, the {QUICK['preset']} preset)")


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_or_report(parse, argv)
    if args is None:
        return 2
    from rltool.data.models import init_model

    from benchmarks.engine_rl import grpo_workload

    w = QUICK if args.quick else FULL
    run = harness.Run("engine_hybrid_prefix", device=args.device)
    root = Path(tempfile.mkdtemp(prefix="engine_hybrid_prefix-"))
    harness.progress(f"random qwen3_5 {w['preset']} checkpoint")
    model = init_model(root / w["preset"], arch="qwen3_5", preset=w["preset"],
                       dtype="bf16" if args.device == "cuda" else "fp32", device=args.device)
    result = grpo_workload(model, device=args.device, prompts=w["prompts"],
                           samples=w["samples"], prompt_len=w["prompt_len"],
                           max_output=w["max_output"])
    arms = ("prefix_cache", "no_prefix_cache")
    harness.print_table(
        ["arm", "prefill tokens", "/ unique", "cached tokens", "seconds", "output tok/s",
         "mean TTFT s"],
        [[arm, result[arm]["prefill_tokens"], result[arm]["prefill_ratio"],
          result[arm]["cached_tokens"], result[arm]["seconds"],
          result[arm]["output_tokens_per_s"], result[arm]["mean_ttft_s"]] for arm in arms])
    cache, fresh = (result[arm] for arm in arms)
    fields = {"quick": args.quick, "workload": w, "result": result,
              "prefill_ratio": cache["prefill_ratio"], "target_ratio": TARGET_RATIO,
              "meets_target": cache["prefill_ratio"] <= TARGET_RATIO,
              "speedup_end_to_end": fresh["seconds"] / cache["seconds"],
              "ttft_ratio": cache["mean_ttft_s"] / fresh["mean_ttft_s"]}
    run.finish(fields, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
