"""What exact train/rollout alignment costs, and what the other modes give.

For each model preset and each engine mode (fp32 | bf16) x (deterministic | not), one real rollout
(`rltool.rollout.stage.run` through `rltool serve --engine builtin`, same prompts, n samples per
prompt, temperature 1) measures the engine's output tokens per wall second; then the align gate
(`rltool.align.gate.check`) recomputes the shard with every trainer mode (fp32 | bf16) x
(deterministic = one unpadded pass per sample | padded micro-batches) and reports
train_rollout_logprob_abs_diff, max |diff| and the recompute time (median of --repeats; it includes
building the trainer model, as a gate run does).

Baselines in the same run: the non-deterministic engine (tokens/s ratio det / non-det) and the
padded trainer recompute (time ratio det / padded).

Usage: python -m benchmarks.align_gate [--presets tiny,small] [--prompts 16] [--n 4]
       [--max-response-len 32] [--repeats 3] [--out DIR_OR_FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rltool.align.gate import check
from rltool.data.models import init_model
from rltool.data.shards import open_shard
from rltool.data.tasks import make_rows, write_prompts
from rltool.rollout.launch import start_engine
from rltool.rollout.stage import RolloutConfig, run

from benchmarks import harness

ENGINE_MODES = [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)]
TRAINER_MODES = [("fp32", True), ("fp32", False), ("bf16", True), ("bf16", False)]


def rollout(model: Path, prompts: Path, out: Path, *, dtype: str, deterministic: bool, n: int,
            num_prompts: int, max_response_len: int, log_dir: Path) -> dict:
    args = ["--engine", "builtin", "--model", str(model), "--dtype", dtype, "--num-threads", "1",
            "--max-running-requests", "64"] + (["--deterministic"] if deterministic else [])
    engine = start_engine(args, log_path=log_dir / f"engine-{out.name}.log")
    try:
        t0 = time.perf_counter()
        run(RolloutConfig(engines=[engine.url], prompts=str(prompts), out=str(out),
                          n_samples_per_prompt=n, max_response_len=max_response_len,
                          reward="reverse", rollout_batch_size=num_prompts, seed=1,
                          concurrency=64, quiet=True))
        wall_s = time.perf_counter() - t0
    finally:
        engine.stop()
    tokens = sum(len(r["response_token_ids"]) for r in open_shard(out).rows())
    return {"wall_s": wall_s, "output_tokens": tokens, "tokens_per_s": tokens / wall_s}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-response-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="Recompute repeats (median time).")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    bench = harness.Run("align_gate")
    root = Path(tempfile.mkdtemp(prefix="align-bench-"))
    prompts = write_prompts(make_rows("reverse", num=args.prompts, seed=5), root / "prompts.jsonl")
    results = []
    for preset in args.presets.split(","):
        model = init_model(root / preset / "weight_v000000", arch="qwen2", preset=preset,
                           task="reverse", seed=0)
        for e_dtype, e_det in ENGINE_MODES:
            name = f"{preset}-{e_dtype}-{'det' if e_det else 'nondet'}"
            shard = root / "rollouts" / name
            eng = rollout(model, prompts, shard, dtype=e_dtype, deterministic=e_det, n=args.n,
                          num_prompts=args.prompts, max_response_len=args.max_response_len,
                          log_dir=root)
            for t_dtype, t_det in TRAINER_MODES:
                # The metric is identical on every repeat; the time is the median (shared box).
                gates = [check([shard], model, tol=0.0, dtype=t_dtype, deterministic=t_det)
                         for _ in range(args.repeats)]
                gate = gates[0]
                results.append({
                    "preset": preset, "engine_dtype": e_dtype, "engine_deterministic": e_det,
                    "trainer_dtype": t_dtype, "trainer_deterministic": t_det,
                    "engine_tokens_per_s": eng["tokens_per_s"], "output_tokens": eng["output_tokens"],
                    "rollout_wall_s": eng["wall_s"],
                    "train_rollout_logprob_abs_diff": gate.metric, "max_abs_diff": gate.max_abs_diff,
                    "recompute_s": statistics.median(g.recompute_s for g in gates),
                    "num_samples": gate.num_samples})
    _print_table(results)
    summary = _summary(results)
    bench.finish({"threads": 1, "args": vars(args), "summary": summary, "results": results},
                 out=args.out)


def _summary(results: list[dict]) -> dict:
    out = {}
    for preset in sorted({r["preset"] for r in results}):
        rows = [r for r in results if r["preset"] == preset]

        def pick(**kw):
            return [r for r in rows if all(r[k] == v for k, v in kw.items())]

        for dtype in ("fp32", "bf16"):
            det = pick(engine_dtype=dtype, engine_deterministic=True)[0]
            non = pick(engine_dtype=dtype, engine_deterministic=False)[0]
            out[f"{preset}/{dtype}/engine_det_over_nondet_tokens_per_s"] = (
                det["engine_tokens_per_s"] / non["engine_tokens_per_s"])
            t_det = pick(engine_dtype=dtype, engine_deterministic=True, trainer_dtype=dtype,
                         trainer_deterministic=True)[0]
            t_pad = pick(engine_dtype=dtype, engine_deterministic=True, trainer_dtype=dtype,
                         trainer_deterministic=False)[0]
            out[f"{preset}/{dtype}/recompute_det_over_padded_time"] = (
                t_det["recompute_s"] / t_pad["recompute_s"])
            out[f"{preset}/{dtype}/det_det_abs_diff"] = t_det["train_rollout_logprob_abs_diff"]
    return out


def _print_table(results: list[dict]) -> None:
    head = (f"{'preset':6} {'engine':12} {'tok/s':>8} {'trainer':12} {'abs_diff':>10} "
            f"{'max':>10} {'recompute_s':>11}")
    print(head)
    print("-" * len(head))
    for r in results:
        eng = f"{r['engine_dtype']}-{'det' if r['engine_deterministic'] else 'nondet'}"
        tr = f"{r['trainer_dtype']}-{'det' if r['trainer_deterministic'] else 'padded'}"
        print(f"{r['preset']:6} {eng:12} {r['engine_tokens_per_s']:8.1f} {tr:12} "
              f"{r['train_rollout_logprob_abs_diff']:10.2e} {r['max_abs_diff']:10.2e} "
              f"{r['recompute_s']:11.2f}")


if __name__ == "__main__":
    main()
