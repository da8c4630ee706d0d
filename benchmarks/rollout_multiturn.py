"""Multi-turn rollout throughput: environment episodes against single-turn samples of the same
output token count through the same engine, and the environment step overhead.

Both variants are `rltool.rollout.stage.run` on one in-process engine (the loop's `[loop] engine =
"inprocess"`), P prompts x S samples, from a random-init model, every request with `ignore_eos`
so every sample produces exactly its budget:
  single-turn  one /generate of TURNS x TOKENS new tokens per sample
  multi-turn   an episode of TURNS model turns of TOKENS tokens each (the episode loop of
               `--env`, rltool.rollout.episode, against `FixedTurns`: after every turn a short
               user message, rendered through the chat template and appended as masked
               tokens; done after TURNS turns)
so both produce P x S x TURNS x TOKENS model tokens; the multi-turn one also prefills the
observations and pays one request per turn. Rounds alternate the two (a change in the machine's
load hits both). Reported: model tokens per second of each (median round), their ratio
(multi / single; the GPU target is >= 0.8), and the environment step overhead: the wall-time
difference per environment step and per episode, and the host cost alone of one step (the
environment call on its worker thread plus rendering and tokenizing the observation), timed
without the engine.

Example:
  python -m benchmarks.rollout_multiturn --device cuda --out benchmarks/results
  python -m benchmarks.rollout_multiturn --device cpu --quick
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from rltool.env.base import Environment, StepResult, task_messages
from rltool.rollout.generate import GenerateContext, Sample, generate_single_turn

# (preset, prompts, samples, turns, tokens per turn, rounds)
WORKLOADS = {
    "cuda": ("qwen2.5-0.5b", 64, 8, 4, 64, 3),
    "cpu": ("tiny", 8, 4, 4, 16, 3),
    "quick": ("tiny", 2, 2, 2, 4, 1),
}
OBSERVATION = "ok, go on."
OBSERVATION_ROOM = 48  # response tokens per turn for the observation after it
HOST_STEPS = 200  # environment steps timed without the engine


class FixedTurns(Environment):
    """An episode of exactly `max_turns` model turns: after each, a short user message."""

    name = "fixed-turns"
    description = "benchmark: answers every turn with a short user message"

    def reset(self, *, seed: int, task: dict[str, Any]) -> list[dict[str, str]]:
        return task_messages(task)

    def step(self, action: dict[str, Any]) -> StepResult:
        return StepResult(observation=[{"role": "user", "content": OBSERVATION}])


@dataclasses.dataclass
class NoEosContext(GenerateContext):
    """Every request with ignore_eos: a sample runs to its token budget."""

    def sampling_params(self, **kwargs: Any) -> dict[str, Any]:
        return {**super().sampling_params(**kwargs), "ignore_eos": True}


def _no_eos(ctx: GenerateContext) -> NoEosContext:
    return NoEosContext(**{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})


async def single_turn(sample: Sample, ctx: GenerateContext) -> Sample:
    """The default single-turn generate function, run to its budget."""
    return await generate_single_turn(sample, _no_eos(ctx))


@functools.lru_cache(maxsize=4)
def _episodes(tokenizer: Any, max_turns: int, tokens_per_turn: int) -> Any:
    """The `--env` generate function over FixedTurns (one per tokenizer and shape, so the
    episodes of a run share its worker threads, as the stage's do)."""
    from rltool.rollout.episode import EnvSource, make_env_generate

    return make_env_generate(EnvSource(f"{__name__}:FixedTurns"), max_turns=max_turns,
                             step_timeout_s=60.0, tokenizer=tokenizer,
                             max_tokens_per_turn=tokens_per_turn)


async def multi_turn(sample: Sample, ctx: GenerateContext) -> Sample:
    """A FixedTurns episode run to its budget; its shape comes with the prompt row
    (metadata `episode`: turns, tokens_per_turn)."""
    shape = sample.metadata["episode"]
    episode = _episodes(ctx.tokenizer, shape["turns"], shape["tokens_per_turn"])
    return await episode(sample, _no_eos(ctx))


def host_step_s(tokenizer: Any, *, steps: int) -> float:
    """Seconds per environment step on the host: `FixedTurns.step` on a worker thread (as the
    episode loop calls it) plus the observation's rendering and tokenization."""
    from rltool.env.threads import CallLimiter, call_in_thread
    from rltool.rollout.episode import ChatRenderer

    renderer, env, limiter = ChatRenderer(tokenizer), FixedTurns(), CallLimiter(4)
    env.reset(seed=0, task={"prompt": "hello"})
    action = {"role": "assistant", "content": "0123", "finish": {}, "tool_calls": []}

    async def run() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            result = await call_in_thread(env.step, action, timeout_s=60.0, what="step",
                                          limiter=limiter)
            renderer.observation_ids("0123", result.observation)
        return (time.perf_counter() - t0) / steps

    return asyncio.run(run())


def measure(device: str, workload: tuple, *, root: Path) -> dict[str, Any]:
    from rltool.data.models import init_model
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.engine.config import ServeConfig
    from rltool.engine.inprocess import InProcessEngine
    from rltool.rollout.prompts import load_tokenizer
    from rltool.rollout.stage import RolloutConfig, run as run_rollout

    preset, prompts, samples, turns, tokens, rounds = workload
    model = init_model(root / "model", arch="qwen2", preset=preset, task="copy", seed=0,
                       fit_vocab=True, device=device)
    shape = {"turns": turns, "tokens_per_turn": tokens}
    write_prompts([{**r, "metadata": {**r["metadata"], "episode": shape}}
                   for r in make_rows("copy", num=prompts, seed=1)], root / "prompts.jsonl")
    rollouts = prompts * samples
    # every sample in flight at once, decoded in one CUDA graph batch; the KV pool holds all of
    # them at their longest (prompt, turns, observations)
    gpu = {"cuda_graph_max_bs": rollouts,
           "max_total_tokens": rollouts * (64 + turns * (tokens + OBSERVATION_ROOM))
           } if device == "cuda" else {}
    engine = InProcessEngine(ServeConfig(model=model, device=device,
                                         max_running_requests=rollouts, **gpu))
    clients = {engine.url: engine}
    times: dict[str, list[float]] = {"single-turn": [], "multi-turn": []}
    counts: dict[str, dict[str, int]] = {}
    load = [harness.load_average()]

    def stage(name: str, k: int) -> float:
        out, multi = root / f"{name}-{k}", name == "multi-turn"
        t0 = time.perf_counter()
        result = run_rollout(RolloutConfig(
            prompts=str(root / "prompts.jsonl"), engines=[engine.url], out=str(out),
            n_samples_per_prompt=samples, rollout_batch_size=prompts, concurrency=rollouts,
            # the episodes' budget has room for an observation (~31 tokens) after each turn
            max_response_len=turns * (tokens + (OBSERVATION_ROOM if multi else 0)),
            generate_fn=f"{__name__}:{'multi_turn' if multi else 'single_turn'}",
            reward="copy:partial", seed=k, quiet=True, metrics=str(root / "metrics.jsonl")),
            clients=clients)
        elapsed = time.perf_counter() - t0
        counts[name] = _count(out)
        assert result["rows"] == rollouts
        return elapsed

    try:
        for k in range(rounds + 1):  # round 0 warms both paths up and is not timed
            harness.progress(f"round {k}/{rounds}")
            for name in times:
                elapsed = stage(name, k)
                if k:
                    times[name].append(elapsed)
            load.append(harness.load_average())
    finally:
        engine.stop()
    tokenizer = load_tokenizer(str(model))
    host = host_step_s(tokenizer, steps=HOST_STEPS)
    med = {k: statistics.median(v) for k, v in times.items()}
    tok_s = {k: counts[k]["model_tokens"] / med[k] for k in med}
    env_steps = counts["multi-turn"]["env_steps"]
    extra = med["multi-turn"] - med["single-turn"]
    return {"workload": {"preset": preset, "prompts": prompts, "samples": samples,
                         "turns": turns, "tokens_per_turn": tokens, "rounds": rounds},
            "median_s": med, "tokens": counts, "model_tok_s": tok_s,
            "multi_over_single": tok_s["multi-turn"] / tok_s["single-turn"],
            "env_step_overhead_s": {"per_step": extra / env_steps,
                                    "per_episode": extra / rollouts,
                                    "host_per_step": host},
            "times_s": times, "load_avg_rounds": load}


def _count(shard_dir: Path) -> dict[str, int]:
    from rltool.data.shards import open_shard

    rows = open_shard(shard_dir).rows()
    model = sum(sum(r["loss_mask"]) for r in rows)
    return {"model_tokens": model,
            "env_tokens": sum(len(r["loss_mask"]) for r in rows) - model,
            "env_steps": sum(len(r["turn_starts"] or []) for r in rows),  # a step per turn
            "rows": len(rows)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="The smallest workload (a smoke "
                        "run: 2 prompts x 2 samples, 2 turns of 4 tokens, one round).")
    parser.add_argument("--out", default=None, help="Write the record to DIR/rollout_multiturn-"
                        "DATE-DEVICE.json (or to this .json file).")
    args = parser.parse_args(argv)
    workload = WORKLOADS["quick" if args.quick else args.device]
    bench = harness.Run("rollout_multiturn", device=args.device)
    with tempfile.TemporaryDirectory(prefix="rltool-rollout-multiturn-") as tmp:
        fields = measure(args.device, workload, root=Path(tmp))
    harness.print_table(
        ["variant", "median_s", "model_tokens", "env_tokens", "model_tok_s"],
        [[k, fields["median_s"][k], fields["tokens"][k]["model_tokens"],
          fields["tokens"][k]["env_tokens"], fields["model_tok_s"][k]]
         for k in ("single-turn", "multi-turn")])
    overhead = fields["env_step_overhead_s"]
    print(f"multi/single tok/s {fields['multi_over_single']:.3f}; env step overhead "
          f"{overhead['per_step'] * 1e3:.2f} ms a step, {overhead['per_episode'] * 1e3:.2f} ms "
          f"an episode (host alone {overhead['host_per_step'] * 1e3:.3f} ms a step)")
    bench.finish(fields, out=args.out)


if __name__ == "__main__":
    main()
