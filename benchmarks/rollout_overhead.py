"""The rollout stage's HTTP/JSON cost on the demo's workload (16 prompts x 8 samples, up to 8 new
tokens, the tiny model on CPU), against the engine generating the same requests in-process.

Per round, alternating (so a change in the machine's load hits every variant):
  engine       the same requests submitted straight to a Scheduler in this process (no HTTP)
  per-sample   one /generate per sample, all in flight at once (EngineClient)
  per-group    one batched /generate per prompt group (what the rollout stage sends)
  stage        `rltool.rollout.stage.run` end to end (setup, generation, rewards, shard write)
               against the served engine
  stage-inprocess  the same stage with the engine on a thread of this process
               (rltool.engine.inprocess, the loop's `[loop] engine = "inprocess"`)

Prints the median seconds of each and the ratio to `engine`, then one JSON line; `--out DIR`
also writes it as DIR/rollout_overhead-DATE-DEVICE.json.

Example:
  OMP_NUM_THREADS=1 python -m benchmarks.rollout_overhead --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

PROMPTS, SAMPLES, MAX_NEW = 16, 8, 8


def sampling(i: int) -> dict[str, Any]:
    return {"max_new_tokens": MAX_NEW, "temperature": 1.0, "sampling_seed": 1000 + i}


def in_process(model: Path, prompts: list[list[int]]) -> float:
    from rltool.engine.api import GenerateInput
    from rltool.engine.expand import expand_generate
    from rltool.engine.config import ServeConfig
    from rltool.engine.server import build_engine

    runner, sched = build_engine(ServeConfig(model=model, device="cpu", max_running_requests=128))
    sched.start()
    try:
        body = GenerateInput(input_ids=[p for p in prompts for _ in range(SAMPLES)],
                             sampling_params=[sampling(i) for i in range(len(prompts) * SAMPLES)],
                             return_logprob=True)
        reqs, _ = expand_generate(body, tokenizer=runner.tokenizer,
                                  context_length=runner.context_length,
                                  vocab_size=runner.vocab_size, deterministic=False)
        import threading

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
        done.wait(600)
        return time.perf_counter() - t0
    finally:
        sched.stop()


async def over_http(url: str, prompts: list[list[int]], *, grouped: bool) -> float:
    from rltool.rollout.client import EngineClient

    async with EngineClient(url) as client:
        t0 = time.perf_counter()
        if grouped:
            calls = [client.generate({"input_ids": [p] * SAMPLES, "return_logprob": True,
                                      "sampling_params": [sampling(g * SAMPLES + i)
                                                          for i in range(SAMPLES)]})
                     for g, p in enumerate(prompts)]
        else:
            calls = [client.generate({"input_ids": p, "return_logprob": True,
                                      "sampling_params": sampling(g * SAMPLES + i)})
                     for g, p in enumerate(prompts) for i in range(SAMPLES)]
        await asyncio.gather(*calls)
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from rltool.data.models import init_model
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.rollout.launch import start_engine
    from rltool.rollout.prompts import load_prompts, load_tokenizer, render_prompt
    from rltool.rollout.stage import RolloutConfig, run as run_rollout

    from rltool.engine.config import ServeConfig
    from rltool.engine.inprocess import InProcessEngine

    times: dict[str, list[float]] = {k: [] for k in ("engine", "per-sample", "per-group", "stage",
                                                     "stage-inprocess")}
    bench = harness.Run("rollout_overhead")
    load = [harness.load_average()]
    with tempfile.TemporaryDirectory(prefix="rltool-rollout-overhead-") as tmp:
        root = Path(tmp)
        model = init_model(root / "model", arch="qwen2", preset="tiny", task="copy", seed=0)
        write_prompts(make_rows("copy", num=PROMPTS, seed=1), root / "rl.jsonl")
        tok = load_tokenizer(str(model))
        prompts = [render_prompt(tok, p) for p in load_prompts(str(root / "rl.jsonl"))][:PROMPTS]
        engine = start_engine(["--engine", "builtin", "--model", str(model),
                               "--max-running-requests", "128"],
                              log_path=root / "engine.log", ready_timeout_s=300)
        local = InProcessEngine(ServeConfig(model=model, max_running_requests=128))

        def stage(name: str, url: str, clients: dict[str, Any] | None) -> float:
            t0 = time.perf_counter()
            run_rollout(RolloutConfig(prompts=str(root / "rl.jsonl"), reward="copy:partial",
                                      n_samples_per_prompt=SAMPLES, rollout_batch_size=PROMPTS,
                                      max_response_len=MAX_NEW, engines=[url],
                                      out=str(root / name), quiet=True,
                                      metrics=str(root / "m.jsonl")), clients=clients)
            return time.perf_counter() - t0

        try:
            for k in range(args.rounds):
                times["engine"].append(in_process(model, prompts))
                times["per-sample"].append(asyncio.run(over_http(engine.url, prompts,
                                                                 grouped=False)))
                times["per-group"].append(asyncio.run(over_http(engine.url, prompts,
                                                                grouped=True)))
                times["stage"].append(stage(f"r{k}", engine.url, None))
                times["stage-inprocess"].append(stage(f"l{k}", local.url, {local.url: local}))
                load.append(harness.load_average())
        finally:
            engine.stop()
            local.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:>10s}: {v:.3f}s median ({v / med['engine']:.2f}x engine)")
    bench.finish({"workload": {"prompts": PROMPTS, "samples": SAMPLES, "max_new_tokens": MAX_NEW},
                  "median_s": med,
                  "ratio_to_engine": {k: v / med["engine"] for k, v in med.items()},
                  "times_s": times, "load_avg_rounds": load}, out=args.out)


if __name__ == "__main__":
    main()
