"""Host time per decode step of the paged engine, measured on CPU.

On a GPU the decode forward is one CUDA-graph replay and sampling one kernel, so what bounds a small
model's step at large batches is the Python around them: the scheduler's per-request work
(recording tokens, stop checks, streaming), the runner's page-table bookkeeping and the tensors it
builds. This benchmark runs the same scheduler and runner on CPU with the tiny model and splits
each decode step's wall time into device work (the model forward `PagedRunner._decode_forward` and
the sampler's tensor math `batch_sampling._torch_sample`, both timed around the call) and host
work (the rest). Requests: B concurrent, 16-token prompts, temperature 1.0, `ignore_eos`,
`return_logprob` (what an RL rollout sends), all admitted at once, so every measured step decodes
exactly B requests.

`--num-continuous-decode-steps 1,4` measures instead the CUDA engine's decode path, once per
value: the overlapped path (device-fed input ids, blocks of N decode steps per scheduler iteration,
one read-back per block), with the Triton sampler replaced by a torch stand-in of the same
signature (timed as device work; the Triton interpreter would take seconds per step). A row's
host time is then per decode step of the block, and per token.

Usage: python benchmarks/engine_host.py [--batches 64,256] [--steps 64] [--repeats 3]
       [--num-continuous-decode-steps 1,4] [--cpu-time] [--profile N] [--out FILE.json]
Prints a table (median host µs per step over the repeats, each repeat's median over its steps)
and, last, one JSON line. --profile N prints cProfile's top N functions of the decode steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from rltool.data.models import init_model
from rltool.engine import batch_sampling, sampling_kernel
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams

PROMPT_LEN = 16


class StepClock:
    """Accumulates the time of the wrapped calls within the current decode step: wall time, or
    with `cpu` the thread's CPU time (what other processes on a loaded machine do not inflate)."""

    def __init__(self, cpu: bool = False) -> None:
        self.now = time.thread_time if cpu else time.perf_counter
        self.device = 0.0
        # (batch, wall s, device s, decode steps) per call of the scheduler's decode step
        self.steps: list[tuple[int, float, float, int]] = []

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.device += self.now() - t0

        return wrapper

    def step(self, fn, sched: PagedScheduler, profiler: cProfile.Profile | None):
        def wrapper() -> None:
            batch = len(sched.running)
            forwards = sched.num_decode_forwards
            self.device = 0.0
            t0 = self.now()
            if profiler is None:
                fn()
            else:
                profiler.runcall(fn)
            self.steps.append((batch, self.now() - t0, self.device,
                               max(sched.num_decode_forwards - forwards, 1)))

        return wrapper


def stand_in_sample_rows(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                         greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling_kernel.sample_rows`'s signature and outputs (the argmax of logits / T and its
    logprob) in torch: the device work of the CUDA path's sampler, on CPU."""
    x = logits.float() / temps.unsqueeze(1)
    tokens = x.argmax(dim=-1)
    return tokens, torch.log_softmax(x, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def run(model_dir: Path, batch: int, steps: int, *, profiler: cProfile.Profile | None,
        multistep: int | None, cpu_time: bool = False) -> dict:
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=batch,
                         max_total_tokens=batch * (PROMPT_LEN + steps + 64))
    if multistep is not None:  # the CUDA engine's decode path (see the module docstring)
        runner.triton_kernels = True
    sched = PagedScheduler(runner, max_running=batch, max_prefill_tokens=batch * PROMPT_LEN,
                           num_continuous_decode_steps=multistep or 1)
    clock = StepClock(cpu_time)
    runner._decode_forward = clock.timed(runner._decode_forward)
    original_sampler = batch_sampling._torch_sample
    batch_sampling._torch_sample = clock.timed(original_sampler)
    original_kernel = sampling_kernel.sample_rows
    sampling_kernel.sample_rows = clock.timed(stand_in_sample_rows)
    sched._decode_step = clock.step(sched._decode_step, sched, profiler)
    done = threading.Semaphore(0)
    reqs = [Request(rid=f"h{i}", prompt_ids=[(7 * i + j) % 40 + 3 for j in range(PROMPT_LEN)],
                    on_finish=lambda r: done.release(), return_logprob=True,
                    params=SamplingParams(max_new_tokens=steps + 1, temperature=1.0,
                                          ignore_eos=True))
            for i in range(batch)]
    sched.start()
    try:
        sched.submit(reqs)
        for _ in reqs:
            assert done.acquire(timeout=600), "the run did not finish"
    finally:
        sched.stop()
        batch_sampling._torch_sample = original_sampler
        sampling_kernel.sample_rows = original_kernel
    # Per decode step: a call that ran a block of n steps counts as n steps of 1/n its time.
    full = [(wall / n, dev / n) for b, wall, dev, n in clock.steps if b == batch]
    assert len(full) >= steps // (4 * (multistep or 1)), \
        f"only {len(full)} calls decoded all {batch} requests"
    return {"steps": len(full),
            "host_us": statistics.median(w - d for w, d in full) * 1e6,
            "wall_us": statistics.median(w for w, _ in full) * 1e6,
            "device_us": statistics.median(d for _, d in full) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions")
    ap.add_argument("--cpu-time", action="store_true",
                    help="the scheduler thread's CPU time instead of wall time (loaded machines)")
    ap.add_argument("--num-continuous-decode-steps", default="",
                    help="comma-separated: the CUDA engine's decode path with blocks of N steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    modes = ([int(n) for n in args.num_continuous_decode_steps.split(",")]
             if args.num_continuous_decode_steps else [None])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model(Path(tmp) / "tiny", arch="qwen2", preset="tiny", task="reverse",
                               seed=0)
        for batch, multistep in [(b, m) for m in modes for b in batches]:
            profiler = cProfile.Profile() if args.profile else None
            runs = [run(model_dir, batch, args.steps, profiler=profiler, multistep=multistep,
                        cpu_time=args.cpu_time) for _ in range(args.repeats)]
            rows.append({"batch": batch, "num_continuous_decode_steps": multistep,
                         "host_us": statistics.median(r["host_us"] for r in runs),
                         "host_us_runs": [round(r["host_us"], 1) for r in runs],
                         "wall_us": statistics.median(r["wall_us"] for r in runs),
                         "device_us": statistics.median(r["device_us"] for r in runs)})
            if profiler is not None:
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
                print(text.getvalue())
    total = "CPU" if args.cpu_time else "wall"  # the clock of every column
    print(f"| N | B | host µs/step | host µs/token | {total} µs/step | device µs/step | "
          "host runs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["num_continuous_decode_steps"]
        print(f"| {'-' if n is None else n} | {r['batch']} | {r['host_us']:.0f} | "
              f"{r['host_us'] / r['batch']:.2f} | "
              f"{r['wall_us']:.0f} | {r['device_us']:.0f} | {r['host_us_runs']} |")
    result = {"benchmark": "engine_host", "date": datetime.now(timezone.utc).isoformat(),
              "machine": platform.node(), "threads": args.threads, "steps": args.steps,
              "clock": "thread CPU time" if args.cpu_time else "wall",
              "torch": torch.__version__, "rows": rows}
    if args.out:
        from rltool.atomic import write_json

        write_json(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
