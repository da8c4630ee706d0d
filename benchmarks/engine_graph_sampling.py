"""Wall against GPU time per decode step of the CUDA engine, with the sampler inside the decode
CUDA graph and after it (the before/after of rltool.engine.decode_sample), in one run.

Two engines per preset over the same random-init checkpoint (bf16), built one after the other:
`apart` (PagedRunner(graph_sampling=False): the graph replays the forward, then the Triton sampler
is launched) and `graph` (the default: one replay does forward, sample and the next step's inputs).
Per engine and batch B, workload (a) of benchmarks/engine_gpu (B requests of 128-token prompts,
256 output tokens, temperature 1.0, ignore_eos, logprobs) runs `--repeats` times, traced
(rltool.trace): the wall time per decode step is the median `decode.step` span over the steps
that decoded all B requests (a block of N steps counts as N steps), the engine's own clock.
The GPU time per step is the median of back-to-back steps on the device alone, between CUDA
events: the bucket's graph replayed (and, for `apart`, the sampler launched after it), so the
host never sets the pace there. wall / GPU near 1 means the GPU sets the pace.

Then, per engine and batch, one more run of the workload under torch.profiler
(rltool.profile.torch_trace.profiled, `profile` in the JSON): the device's busy fraction of the
unprofiled run's seconds, the idle gaps between device work (the host setting the pace) and the
kernel that followed each of the longest, device time per kernel kind (GEMM, attention, ...) and the
top kernels, and every synchronizing CUDA call any thread made, by the line that made it.

Usage: python -m benchmarks.engine_graph_sampling [--presets qwen2.5-0.5b,qwen2.5-7b]
       [--batches 64,256] [--repeats 3] [--num-continuous-decode-steps 1] [--out DIR]
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from rltool import trace
from rltool.engine.decode_sample import sample_rows_of
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.profile.engine_steps import decode_steps
from rltool.profile.events import read_events
from rltool.profile.torch_trace import profiled

from benchmarks import harness
from benchmarks.engine_common import prompts_for, random_checkpoint, run_batch, warm_up

ARMS = {"apart": False, "graph": True}  # arm: graph_sampling
GPU_STEPS = 20


def traced_run(sched: PagedScheduler, batch: int, *, seed: int, trace_root: Path) -> dict:
    """Workload (a) at `batch`, traced: its run_batch figures and the median wall µs per decode
    step over the steps that decoded all `batch` requests."""
    folder = Path(tempfile.mkdtemp(dir=trace_root))
    trace.configure(folder, role="engine_graph_sampling")
    try:
        run = run_batch(sched, prompts_for(batch, sched.runner.vocab_size, seed))
    finally:
        trace.configure(None, role="engine_graph_sampling")  # flushes the events
    full = [r for r in decode_steps(read_events(folder)) if r["batch"] == batch]
    assert full, f"no decode step decoded all {batch} requests"
    return {**run, "wall_us": statistics.median(r["wall_us"] for r in full)}


def gpu_step_us(runner: PagedRunner, batch: int) -> float:
    """Median device µs of a decode step at `batch` over GPU_STEPS back-to-back steps (3 runs):
    the bucket's graph replayed, and for an engine without graph sampling the sampler after it."""
    from rltool.engine.sampling_kernel import sample_rows

    rids = [f"gpu{i}" for i in range(batch)]
    runner.prefill([(r, list(range(1, 129)), 0) for r in rids], want=[False] * batch)
    rows = sample_rows_of(np.ones(batch, dtype=np.float32), np.zeros(batch, dtype=np.int32),
                          np.arange(batch, dtype=np.int64), np.full(batch, 128, dtype=np.int64))
    runner.sample_next(rows)
    # The step's inputs (and sampling rows) in the buffer, and the KV pages of every replay
    # below reserved: a graph that samples advances its inputs by a token per replay.
    runner.decode(rids, [1] * batch, steps=1 + 6 * GPU_STEPS)
    graphs = runner.decoder.graphs
    bucket = next(b for b in runner.decoder.buckets if b >= batch)
    dev = runner.device
    temps = torch.ones(batch, device=dev)
    seeds = torch.arange(batch, dtype=torch.int32, device=dev)
    greedy = torch.zeros(batch, dtype=torch.int32, device=dev)
    if runner.graph_sampling:
        graph = graphs.sampled[False][bucket][0]  # the plain race
        step = graph.replay
    else:
        graph, logits = graphs.captured[bucket]

        def step() -> None:
            graph.replay()
            sample_rows(logits[:batch], temps, seeds, greedy)

    for _ in range(5):  # warm
        step()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(GPU_STEPS):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GPU_STEPS)
    for r in rids:
        runner.remove(r)
    return statistics.median(times)


def measure(model_dir: Path, batches: list[int], *, graph_sampling: bool, steps: int,
            repeats: int, trace_root: Path) -> dict:
    """One engine: {batch: wall and GPU µs per step, tokens/s, the sampled-step counters}."""
    runner = PagedRunner(model_dir, device="cuda", dtype="bf16", max_running=max(batches),
                         cuda_graph_max_bs=max(batches), graph_sampling=graph_sampling)
    sched = PagedScheduler(runner, max_running=max(batches), max_prefill_tokens=16384,
                           chunked_prefill_size=8192, num_continuous_decode_steps=steps)
    sched.start()
    out: dict = {}
    try:
        warm_up(sched, batches, runner.vocab_size)
        for b in batches:
            runs = [traced_run(sched, b, seed=3 + b + 1000 * k, trace_root=trace_root)
                    for k in range(repeats)]
            seconds = statistics.median(r["seconds"] for r in runs)
            prompts = prompts_for(b, runner.vocab_size, 5 + b)
            out[b] = {"wall_us": statistics.median(r["wall_us"] for r in runs),
                      "wall_us_runs": [round(r["wall_us"], 1) for r in runs],
                      "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                      "profile": profiled(lambda: run_batch(sched, prompts), seconds)}
        out["counters"] = sched.batch.blocks.stats()
    finally:
        sched.stop()
    for b in batches:
        out[b]["gpu_us"] = gpu_step_us(runner, b)
    runner.release()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2.5-0.5b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-continuous-decode-steps", type=int, default=1)
    ap.add_argument("--out", default=None, help="directory (or .json file) for the record")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("no CUDA device is visible: this benchmark measures the CUDA engine's decode "
                 "graphs; run it on a machine with a GPU")
    bench = harness.Run("engine_graph_sampling", device="cuda")
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {}
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "trace").mkdir()
        for preset in args.presets.split(","):
            model_dir = random_checkpoint(Path(tmp) / preset, preset)
            results[preset] = {arm: measure(model_dir, batches, graph_sampling=on,
                                            steps=args.num_continuous_decode_steps,
                                            repeats=args.repeats,
                                            trace_root=Path(tmp) / "trace")
                               for arm, on in ARMS.items()}
            for b in batches:
                base = results[preset]["apart"][b]
                for arm in ARMS:
                    r = results[preset][arm][b]
                    prof = r["profile"]
                    table.append([preset, b, arm, r["tokens_per_s"], r["wall_us"] / 1e3,
                                  r["gpu_us"] / 1e3, r["wall_us"] / r["gpu_us"],
                                  r["wall_us"] / base["wall_us"], prof["gpu_busy_fraction"],
                                  prof["host_syncs"]["count"], prof["limit"]])
    harness.print_table(["model", "B", "sampling", "tok/s", "wall ms/step", "GPU ms/step",
                         "wall/GPU", "wall vs apart", "GPU busy", "syncs", "limit"], table)
    bench.finish({"num_continuous_decode_steps": args.num_continuous_decode_steps,
                  "repeats": args.repeats, "clock": "wall: decode.step trace spans; GPU: "
                  "CUDA events over back-to-back device steps", "results": results},
                 out=args.out)


if __name__ == "__main__":
    main()
