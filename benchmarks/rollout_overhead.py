"""The rollout stage's HTTP/JSON cost against the engine generating the same requests in-process.

Workload: P prompts (the `copy` task's, chat-templated) x N samples, up to T new tokens each, a
sampling seed per sample; by default the demo's (16 x 8, T = 8, the tiny model on CPU).

Per round, alternating (so a change in the machine's load hits every variant):
  engine       the same requests submitted straight to a scheduler in this process (no HTTP)
  per-sample   one /generate per sample, all in flight at once (EngineClient)
  per-group    one batched /generate per prompt group, all in flight
  batched      the bodies the rollout stage sends: groups packed into bodies of at most
               --samples-per-request samples (rltool.rollout.batching.pack), all in flight
  stage-per-group  `rltool.rollout.stage.run` end to end (setup, generation, rewards, shard write)
               against the served engine with --samples-per-request N: one body per group
  stage        the same with the default --samples-per-request (batched bodies)
  stage-inprocess  the stage with the engine on a thread of this process
               (rltool.engine.inprocess, the loop's `[loop] engine = "inprocess"`)

Prints each variant's median seconds, its ratio to `engine` and its output tokens/s (the tokens
of its last round over its median), then one JSON line; `--out DIR` also writes it as
DIR/rollout_overhead-DATE-DEVICE.json. On cuda the three engines (in-process scheduler, served
engine, in-process engine) share the device, each with about 30% of its memory (started in that
order with --mem-fraction-static 0.3, 0.6, 0.9: an engine fills the device's memory up to
that fraction of it, leaving the rest free, so each adds about 30%).

Examples:
  OMP_NUM_THREADS=1 python -m benchmarks.rollout_overhead --rounds 5
  python -m benchmarks.rollout_overhead --device cuda --preset qwen2.5-0.5b --prompts 64 \\
      --samples 8 --max-new-tokens 512 --max-running-requests 512 --rounds 3 \\
      --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rltool.errors import BadInputError

from benchmarks import harness

VARIANTS = ("engine", "per-sample", "per-group", "batched", "stage-per-group", "stage",
            "stage-inprocess")
CUDA_MEM_FRACTIONS = (0.3, 0.6, 0.9)  # the scheduler's, the served engine's, the local one's


def sampling(i: int, max_new: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "temperature": 1.0, "sampling_seed": 1000 + i}


def in_process(runner: Any, sched: Any, prompts: list[list[int]], *, samples: int,
               max_new: int) -> tuple[float, int]:
    """(seconds, output tokens) of the requests submitted to a running scheduler."""
    from rltool.engine.api import GenerateInput
    from rltool.engine.expand import expand_generate

    body = GenerateInput(input_ids=[p for p in prompts for _ in range(samples)],
                         sampling_params=[sampling(i, max_new)
                                          for i in range(len(prompts) * samples)],
                         return_logprob=True)
    reqs, _ = expand_generate(body, tokenizer=runner.tokenizer,
                              context_length=runner.context_length,
                              vocab_size=runner.vocab_size, max_requests=len(body.input_ids),
                              deterministic=False)
    done = threading.Event()
    left = [len(reqs)]

    def finished(_req: Any) -> None:
        left[0] -= 1
        if left[0] == 0:
            done.set()

    for r in reqs:
        r.on_finish = finished
    t0 = time.perf_counter()
    sched.submit(reqs)
    done.wait(1800)
    return time.perf_counter() - t0, sum(len(r.output_ids) for r in reqs)


async def over_http(url: str, prompts: list[list[int]], *, samples: int, max_new: int,
                    per_body: int | None) -> tuple[float, int]:
    """(seconds, output tokens): per_body None one request per sample, else bodies of whole
    groups packed up to per_body samples."""
    from rltool.rollout.batching import pack
    from rltool.rollout.client import EngineClient, token_counts

    n = len(prompts) * samples
    async with EngineClient(url, keepalive=n) as client:
        if per_body is None:
            calls = [client.generate({"input_ids": p, "return_logprob": True,
                                      "sampling_params": sampling(g * samples + i, max_new)})
                     for g, p in enumerate(prompts) for i in range(samples)]
        else:
            calls = [client.generate({"input_ids": [prompts[g] for g in body for _ in
                                                    range(samples)],
                                      "return_logprob": True,
                                      "sampling_params": [sampling(g * samples + i, max_new)
                                                          for g in body for i in range(samples)]})
                     for body in pack([samples] * len(prompts), limit=per_body)]
        t0 = time.perf_counter()
        answers = await asyncio.gather(*calls)
        seconds = time.perf_counter() - t0
    return seconds, sum(token_counts(a)["completion_tokens"] for a in answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="Samples per prompt (a group).")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--preset", default="tiny", help="Model shapes (rltool.data.models).")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        harness.require_device(args.device)
    except BadInputError as e:
        parser.error(str(e))
    from rltool.data.models import init_model
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.engine.config import ServeConfig
    from rltool.engine.inprocess import InProcessEngine
    from rltool.engine.server import build_engine
    from rltool.rollout.batching import DEFAULT_SAMPLES_PER_REQUEST
    from rltool.rollout.launch import start_engine
    from rltool.rollout.prompts import load_prompts, load_tokenizer, render_prompt
    from rltool.rollout.stage import RolloutConfig, run as run_rollout

    num, samples, max_new = args.prompts, args.samples, args.max_new_tokens
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    tokens: dict[str, int] = {}
    bench = harness.Run("rollout_overhead", device=args.device)
    load = [harness.load_average()]
    serve = {"device": args.device, "max_running_requests": args.max_running_requests,
             "max_queued_requests": max(4096, 2 * num * samples)}
    fractions: list[dict[str, Any]] = [{}, {}, {}]
    if args.device == "cuda":
        serve["dtype"] = "bf16"
        fractions = [{"mem_fraction_static": f} for f in CUDA_MEM_FRACTIONS]
    with tempfile.TemporaryDirectory(prefix="rltool-rollout-overhead-") as tmp:
        root = Path(tmp)
        model = init_model(root / "model", arch="qwen2", preset=args.preset, task="copy", seed=0,
                           fit_vocab=args.preset != "tiny",
                           dtype="bf16" if args.device == "cuda" else "fp32",
                           device=args.device)
        write_prompts(make_rows("copy", num=num, seed=1), root / "rl.jsonl")
        tok = load_tokenizer(str(model))
        prompts = [render_prompt(tok, p) for p in load_prompts(str(root / "rl.jsonl"))][:num]
        runner, sched = build_engine(ServeConfig(model=model, **serve, **fractions[0]))
        sched.start()
        engine = start_engine(["--engine", "builtin", "--model", str(model),
                               *(f"--{k.replace('_', '-')}={v}"
                                 for k, v in (serve | fractions[1]).items())],
                              log_path=root / "engine.log", ready_timeout_s=600)
        local = InProcessEngine(ServeConfig(model=model, **serve, **fractions[2]))

        def stage(name: str, url: str, clients: dict[str, Any] | None,
                  per_request: int = DEFAULT_SAMPLES_PER_REQUEST) -> tuple[float, int]:
            t0 = time.perf_counter()
            result = run_rollout(RolloutConfig(
                prompts=str(root / "rl.jsonl"), reward="copy:partial", seed=0,
                n_samples_per_prompt=samples, rollout_batch_size=num, max_response_len=max_new,
                engines=[url], out=str(root / name), quiet=True, concurrency=num * samples,
                samples_per_request=per_request, metrics=str(root / "m.jsonl")), clients=clients)
            return time.perf_counter() - t0, int(result["metrics"]["perf/output_tokens"])

        def http(per_body: int | None) -> tuple[float, int]:
            return asyncio.run(over_http(engine.url, prompts, samples=samples, max_new=max_new,
                                         per_body=per_body))

        arms = {
            "engine": lambda k: in_process(runner, sched, prompts, samples=samples,
                                           max_new=max_new),
            "per-sample": lambda k: http(None),
            "per-group": lambda k: http(samples),
            "batched": lambda k: http(DEFAULT_SAMPLES_PER_REQUEST),
            "stage-per-group": lambda k: stage(f"g{k}", engine.url, None, per_request=samples),
            "stage": lambda k: stage(f"r{k}", engine.url, None),
            "stage-inprocess": lambda k: stage(f"l{k}", local.url, {local.url: local}),
        }
        try:
            for k in range(args.rounds):
                for name, arm in arms.items():
                    seconds, tokens[name] = arm(k)
                    times[name].append(seconds)
                load.append(harness.load_average())
                harness.progress(f"round {k + 1}/{args.rounds}")
        finally:
            engine.stop()
            local.stop()
            sched.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    tok_s = {k: tokens[k] / med[k] for k in VARIANTS}
    for k, v in med.items():
        print(f"{k:>16s}: {v:.3f}s median ({v / med['engine']:.2f}x engine), "
              f"{tok_s[k]:,.0f} output tok/s")
    bench.finish({"workload": {"prompts": num, "samples": samples, "max_new_tokens": max_new,
                               "preset": args.preset, "serve": serve,
                               "samples_per_request": DEFAULT_SAMPLES_PER_REQUEST},
                  "median_s": med, "ratio_to_engine": {k: v / med["engine"] for k, v in med.items()},
                  "output_tokens_per_s": tok_s, "output_tokens_last_round": tokens,
                  "times_s": times, "load_avg_rounds": load}, out=args.out)


if __name__ == "__main__":
    main()
