"""Decode throughput of the builtin engine serving a LoRA adapter, against the base model, on one
GPU.

Workload (a)'s shapes (benchmarks/engine_gpu.py): a random-init bf16 checkpoint of `--preset`,
B concurrent requests of 128-token random prompts, each exactly 256 output tokens at temperature
1 with ignore_eos, in process on a fresh engine per arm (CUDA graphs on), after an untimed
warm-up of each batch size on other prompts. Arms:
  base        the engine without --enable-lora
  lora-rR     --enable-lora --max-lora-rank R with a random rank-R adapter on every linear
              (q/k/v/o/gate/up/down) installed as the policy adapter by a disk weight sync, so
              the requests (no lora_path) all run it: every linear adds x A^T B^T
  mixed-rR    (--mixed) the same engine with two such adapters loaded by name, the requests
              alternating between them: one adapter per forward, so the two halves take turns
Per arm and batch: output tokens/s, decode forwards, and the ratio of tokens/s to the base's.

Usage: python -m benchmarks.engine_lora [--preset qwen2.5-0.5b] [--batches 64] [--ranks 16,64]
       [--mixed] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch

from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams

from benchmarks import harness
from benchmarks.engine_common import (OUTPUT_LEN, fresh_engine, prompts_for, random_checkpoint,
                                      run_batch, warm_up)


def random_adapter(model_dir: Path, out: Path, *, rank: int, seed: int) -> Path:
    """The trainer's rank-`rank` LoRA (rltool.train.lora.LoRA, alpha 2 x rank) on every linear
    of the model, random A and B, written as the trainer publishes one (`write_adapter`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rltool.train.config import LORA_DEFAULT_TARGETS
    from rltool.train.lora import LoRA, is_adapter_key, write_adapter

    with torch.device("meta"):  # the linears' shapes only: the adapters live on the host
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    lora = LoRA(model, rank=rank, alpha=2 * rank, dropout=0.0,
                targets=list(LORA_DEFAULT_TARGETS), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    for key, t in tensors.items():
        if key.endswith(".lora_B.weight"):  # the trainer starts B at zero: the base's outputs
            t.copy_(torch.randn(t.shape, generator=gen) * 0.01)
    out.mkdir(parents=True)
    write_adapter(out, tensors=tensors, config=lora.peft_config(model_dir))
    return out


def mixed_batch(sched, prompts: list[list[int]], names: list[str]) -> dict:
    """One timed batch whose request i runs adapter names[i % len(names)]: output tokens/s."""
    done, finished = threading.Event(), []

    def on_finish(req: Request) -> None:
        finished.append(req)
        if len(finished) == len(prompts):
            done.set()

    forwards = sched.num_decode_forwards
    tag = sched.next_seq()
    reqs = [Request(rid=f"m{tag}-{i}", prompt_ids=list(p), lora=names[i % len(names)],
                    on_finish=on_finish,
                    params=SamplingParams(max_new_tokens=OUTPUT_LEN, temperature=1.0,
                                          ignore_eos=True))
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    sched.submit(reqs)
    assert done.wait(1800), "engine run did not finish"
    elapsed = time.perf_counter() - t0
    out = sum(len(r.output_ids) for r in reqs)
    assert out == OUTPUT_LEN * len(reqs), "requests stopped early"
    return {"seconds": elapsed, "output_tokens": out, "tokens_per_s": out / elapsed,
            "decode_steps": sched.num_decode_forwards - forwards}


def arm(model_dir: Path, batches: list[int], *, rank: int = 0, adapters: list[Path] = (),
        mixed: bool = False) -> dict:
    """One arm on a fresh engine: {batch: run}."""
    options = {"enable_lora": True, "max_lora_rank": rank} if rank else {}
    with fresh_engine(model_dir, batches, **options) as (runner, sched):
        names = []
        if adapters and not mixed:
            sched.update_weights(lambda: runner.load_weights(adapters[0]),
                                 abort_all=False).result()
        for i, path in enumerate(adapters if mixed else ()):
            names.append(f"a{i}")
            sched.call(lambda name=names[-1], p=path: runner.lora.load(name, p)).result()
        warm_up(sched, batches, runner.vocab_size)
        return {b: (mixed_batch(sched, prompts_for(b, runner.vocab_size, 3 + b), names)
                    if mixed else run_batch(sched, prompts_for(b, runner.vocab_size, 3 + b)))
                for b in batches}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--ranks", default="16")
    ap.add_argument("--mixed", action="store_true", help="also two adapters, requests alternating")
    ap.add_argument("--out", default=None, help="directory (or .json file) for the record")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("no CUDA device is visible; the benchmark needs a GPU")
    batches = [int(b) for b in args.batches.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    run = harness.Run("engine_lora", device="cuda")
    root = Path(tempfile.mkdtemp())
    model_dir = random_checkpoint(root / args.preset, args.preset)
    results = {"base": arm(model_dir, batches)}
    harness.progress(f"base: {[round(results['base'][b]['tokens_per_s']) for b in batches]}")
    for rank in ranks:
        paths = [random_adapter(model_dir, root / f"lora-r{rank}-{i}", rank=rank, seed=i)
                 for i in range(2 if args.mixed else 1)]
        results[f"lora-r{rank}"] = arm(model_dir, batches, rank=rank, adapters=paths[:1])
        if args.mixed:
            results[f"mixed-r{rank}"] = arm(model_dir, batches, rank=rank, adapters=paths,
                                            mixed=True)
    rows = []
    for name, runs in results.items():
        for b in batches:
            r = runs[b]
            rows.append({"arm": name, "batch": b, "tokens_per_s": r["tokens_per_s"],
                         "decode_steps": r["decode_steps"],
                         "vs_base": r["tokens_per_s"] / results["base"][b]["tokens_per_s"]})
    harness.print_table(["arm", "B", "tok/s", "decode steps", "vs base"],
                        [[r["arm"], r["batch"], round(r["tokens_per_s"]), r["decode_steps"],
                          round(r["vs_base"], 3)] for r in rows])
    run.finish({"preset": args.preset, "batches": batches, "ranks": ranks, "results": rows},
               out=args.out, detail={"runs": results})


if __name__ == "__main__":
    main()
