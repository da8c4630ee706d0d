"""Requests arriving over time on a warmed-up engine: what each prefill attention compiles and how
fast it serves, grouped against varlen (`--prefill-attention`).

Workload: ARRIVAL_PATTERNS patterns (`arrival_patterns`): batches of 1 to 64 requests whose
prompts are 17 to 1500 tokens long, a quarter of them over a shared prefix that the pattern
before left in the prefix cache; each pattern's requests arrive in up to four waves
WAVE_GAP_S apart (later waves join the running batch as mixed prefill steps). Each arm runs in a
process of its own (no arm finds kernels another compiled), on a fresh engine of a random-init
bf16 `--preset` (warmed up at build: rltool.engine.paged_forward.PagedForward.warm_up), twice
over the patterns: the first pass meets every shape for the first time (its compile counts are
the point: a warmed-up engine should compile nothing), the second repeats them with other token
ids (steady state). Per arm and pass: seconds, prompt and output tokens per second, and the
engine's `compiles_since_warmup` (rltool.engine.compile_watch: Triton variants JIT-built, dynamo
graphs, new SDPA shapes as a proxy for attention plans), with the varlen/grouped ratios.

Usage: python -m benchmarks.engine_arrivals [--preset qwen2.5-0.5b] [--new-tokens 32] [--out DIR]
(on a CUDA GPU; without one it exits 2 with one line)
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rltool.errors import BadInputError

from benchmarks import harness

ARRIVAL_PATTERNS = 20
BATCH_SIZES = (1, 64, 3, 17, 2, 48, 7, 33, 1, 64, 5, 24, 11, 40, 2, 56, 9, 16, 31, 4)
MIN_PROMPT, MAX_PROMPT = 17, 1500
WAVE_GAP_S = 0.01
ARMS = ("grouped", "varlen")


def arrival_patterns(vocab: int, seed: int) -> list[list[list[list[int]]]]:
    """ARRIVAL_PATTERNS patterns, each a list of waves of prompts. Their shapes (batch sizes,
    prompt lengths 17..MAX_PROMPT drawn log-uniform, waves) are the same for every `seed`; the
    token ids (within `vocab`, away from its ends) are the seed's. Patterns 4k+2 and 4k+3 put
    their prompts over one of three shared prefixes (100, 400 and 900 tokens): the first fills
    the prefix cache with it, the second finds it there."""
    shapes, tokens = random.Random(0), random.Random(seed)
    lo = min(100, vocab // 4)

    def ids(n: int) -> list[int]:
        return [tokens.randrange(lo, vocab - lo) for _ in range(n)]

    prefixes = [ids(n) for n in (100, 400, 900)]
    patterns = []
    for i, size in enumerate(BATCH_SIZES[:ARRIVAL_PATTERNS]):
        prefix = prefixes[(i // 4) % 3] if i % 4 >= 2 else []
        prompts = []
        for _ in range(size):
            n = round(MIN_PROMPT * (MAX_PROMPT / MIN_PROMPT) ** shapes.random())
            prompts.append(prefix + ids(max(n - len(prefix), 1 if prefix else MIN_PROMPT)))
        cuts = sorted(shapes.sample(range(1, size), min(shapes.randrange(4), size - 1)))
        patterns.append([prompts[a:b] for a, b in zip([0] + cuts, cuts + [size])])
    return patterns


def run_pattern(sched, waves: list[list[list[int]]], *, tag: str, new_tokens: int,
                timeout_s: float = 300.0) -> dict:
    """Submit the waves WAVE_GAP_S apart, wait for every request; seconds, prompt and output
    tokens."""
    from rltool.engine.request import Request
    from rltool.engine.sampling import SamplingParams

    total = sum(len(w) for w in waves)
    done, finished = threading.Event(), []

    def on_finish(req) -> None:
        finished.append(req)
        if len(finished) == total:
            done.set()

    t0 = time.perf_counter()
    reqs = []
    for w, wave in enumerate(waves):
        if w:
            time.sleep(WAVE_GAP_S)
        batch = [Request(rid=f"{tag}-{w}-{i}", prompt_ids=list(p), on_finish=on_finish,
                         params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                               ignore_eos=True))
                 for i, p in enumerate(wave)]
        reqs += batch
        sched.submit(batch)
    assert done.wait(timeout_s), f"arrival pattern {tag} did not finish in {timeout_s} s"
    bad = [r.rid for r in reqs if len(r.output_ids) != new_tokens]
    assert not bad, f"requests that stopped before their max_new_tokens: {bad[:5]}"
    return {"seconds": time.perf_counter() - t0, "requests": total,
            "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
            "output_tokens": total * new_tokens}


def run_arm(model_dir: Path, attention: str, *, new_tokens: int) -> dict:
    """One arm on a fresh engine: the two passes over the patterns, and the compiles each added
    (`compiles_since_warmup` read before and after)."""
    from rltool.engine.paged_runner import PagedRunner
    from rltool.engine.paged_scheduler import PagedScheduler

    runner = PagedRunner(model_dir, device="cuda", dtype="bf16", max_running=64,
                         cuda_graph_max_bs=64, prefill_attention=attention)
    sched = PagedScheduler(runner, max_running=64, max_prefill_tokens=16384,
                           chunked_prefill_size=8192)
    sched.start()
    passes = []
    try:
        for p in range(2):
            patterns = arrival_patterns(runner.vocab_size, seed=10 + p)
            before = sched.stats()["compiles_since_warmup"]
            runs = [run_pattern(sched, waves, tag=f"p{p}-{i}", new_tokens=new_tokens)
                    for i, waves in enumerate(patterns)]
            after = sched.stats()["compiles_since_warmup"]
            seconds = sum(r["seconds"] for r in runs)
            passes.append({
                "pass": p, "seconds": seconds, "requests": sum(r["requests"] for r in runs),
                "prompt_tok_per_s": sum(r["prompt_tokens"] for r in runs) / seconds,
                "output_tok_per_s": sum(r["output_tokens"] for r in runs) / seconds,
                **{k: after[k] - before[k] for k in ("total", "triton", "dynamo", "sdpa_shapes")},
                "triton_kernels": {k: n - before["triton_kernels"].get(k, 0)
                                   for k, n in after["triton_kernels"].items()
                                   if n != before["triton_kernels"].get(k, 0)}})
    finally:
        sched.stop()
        runner.release()
    return {"attention": attention, "passes": passes}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--new-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--out", default=None, help="a directory (or .json path) for the record")
    ap.add_argument("--arm", choices=ARMS, default=None,
                    help="internal: run one arm on --model and print its JSON")
    ap.add_argument("--model", default=None, help="internal: the checkpoint of --arm")
    args = ap.parse_args(argv)
    if args.new_tokens < 1:
        ap.error("--new-tokens must be at least 1")
    if (args.arm is None) != (args.model is None):
        ap.error("--arm and --model go together (the parent process passes both)")
    import torch

    if not torch.cuda.is_available():
        raise BadInputError("engine_arrivals runs on a CUDA GPU and none is visible; run it on "
                            "a GPU host")
    return args


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_or_report(parse, argv)
    if args is None:
        return 2
    if args.arm is not None:
        print(json.dumps(run_arm(Path(args.model), args.arm, new_tokens=args.new_tokens)))
        return 0
    from benchmarks.engine_common import random_checkpoint

    run = harness.Run("engine_arrivals", device="cuda")
    arms = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = random_checkpoint(Path(tmp) / "model", args.preset)
        for arm in ARMS:
            harness.progress(f"arm {arm}")
            out = subprocess.run([sys.executable, "-m", "benchmarks.engine_arrivals", "--arm", arm,
                                  "--model", str(model), "--new-tokens", str(args.new_tokens)],
                                 check=True, stdout=subprocess.PIPE, text=True)
            arms[arm] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [[arm, p["pass"], p["seconds"], p["prompt_tok_per_s"], p["output_tok_per_s"],
             p["total"], p["triton"], p["sdpa_shapes"], p["dynamo"]]
            for arm in ARMS for p in arms[arm]["passes"]]
    harness.print_table(["attention", "pass", "s", "prompt tok/s", "output tok/s", "compiles",
                         "triton", "sdpa shapes", "dynamo"], rows)
    ratios = {f"pass{p}": arms["grouped"]["passes"][p]["seconds"]
              / arms["varlen"]["passes"][p]["seconds"] for p in range(2)}
    print(f"varlen speed-up over grouped (seconds ratio): {ratios}", file=sys.stderr)
    run.finish({"preset": args.preset, "new_tokens": args.new_tokens, "arms": arms,
                "varlen_speedup": ratios}, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
