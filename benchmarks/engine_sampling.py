"""The sampling arm of `python -m benchmarks.engine_gpu` throughput mode (`--sampling
plain,filtered`): workload (a) once per arm on the same engine, each arm's requests sampling with
its parameters, and the sampler alone on random logits of the model's vocabulary.

Arms: plain (temperature 1) and filtered (temperature 1, top_p 0.9, top_k 50). Per arm and batch
size: output tokens/s, decode forwards, and the overlapped decode blocks the scheduler launched
(`overlap_blocks`; those that raced over filtered logits in `filtered_blocks`), so a run shows
whether filtered sampling kept decode overlap on; then the ratio of each arm's tokens/s to the
first arm's. The sampler alone: the median seconds of a `sample_batch` call (between device
syncs) at each batch.
"""

from __future__ import annotations

import argparse

import torch

from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.sampling import SamplingParams

from benchmarks import harness
from benchmarks.engine_common import prompts_for, run_batch

ARMS = {"plain": {}, "filtered": {"top_p": 0.9, "top_k": 50}}


def parse_arms(spec: str) -> list[str]:
    """`--sampling` (an argparse type): the arms, in order."""
    arms = [a for a in spec.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown arm {bad[0]!r}; use a comma-separated list "
                                         f"of {', '.join(ARMS)}")
    return arms


def sampling_runs(sched: PagedScheduler, batches: list[int], vocab: int,
                  arms: list[str]) -> dict:
    """Workload (a) per arm on a started scheduler (warmed up by the caller): {arm: {batch:
    run_batch result + overlap_blocks, filtered_blocks, tokens_per_s_vs_<first arm>}}."""
    blocks = sched.batch.blocks
    out: dict = {}
    for k, arm in enumerate(arms):
        out[arm] = {}
        for b in batches:
            launches, filtered = blocks.launches, blocks.draw_launches
            run = run_batch(sched, prompts_for(b, vocab, 5_000 + 100 * k + b),
                            sampling=ARMS[arm])
            run["overlap_blocks"] = blocks.launches - launches
            run["filtered_blocks"] = blocks.draw_launches - filtered
            out[arm][b] = run
            run[f"tokens_per_s_vs_{arms[0]}"] = (run["tokens_per_s"]
                                                 / out[arms[0]][b]["tokens_per_s"])
    return out


def sampler_alone(batches: list[int], vocab: int, arms: list[str], *,
                  device: str = "cuda") -> dict:
    """{arm: {batch: median seconds of a sample_batch call}} on random bf16 logits [B, vocab]."""
    from rltool.engine.batch_sampling import sample_batch

    out: dict = {}
    for arm in arms:
        out[arm] = {}
        for b in batches:
            logits = torch.randn(b, vocab, device=device, dtype=torch.bfloat16) * 4
            params = [SamplingParams(temperature=1.0, **ARMS[arm])] * b
            kw = dict(generators=[None] * b, suppressed=[[]] * b, top_n=[0] * b,
                      token_ids=[None] * b, seeds=list(range(b)), use_kernel=True)
            sample_batch(logits, params, **kw)  # compiles
            out[arm][b] = harness.median_s(lambda: sample_batch(logits, params, **kw),
                                           repeats=20, device=device)
    return out


def print_table(runs: dict, alone: dict, preset: str) -> None:
    first = list(runs)[0]
    harness.print_table(
        ["model", "sampling", "B", "engine tok/s", f"vs {first}", "overlap blocks", "filtered",
         "sampler ms"],
        [(preset, arm, b, r["tokens_per_s"], r[f"tokens_per_s_vs_{first}"], r["overlap_blocks"],
          r["filtered_blocks"], alone[arm][b] * 1e3)
         for arm, by_batch in runs.items() for b, r in by_batch.items()])
