"""Host time per decode step of the paged engine, measured on CPU from the engine's own trace.

On a GPU the decode forward is one CUDA-graph replay and sampling one kernel, so what bounds a small
model's step at large batches is the Python around them: the scheduler's per-request work
(recording tokens, stop checks, streaming), the runner's page-table bookkeeping and the tensors it
builds. This benchmark runs the same scheduler and runner on CPU with the tiny model, traced
(rltool.trace): the engine marks each decode step (`decode.step`), the model's decode forward
(`decode.forward`) and the sampler (`decode.sample`), and rltool.profile.engine_steps splits each
step's wall time into device work (the forward and sampler spans) and host work (the rest).
Requests: B concurrent, 16-token prompts, temperature 1.0, `ignore_eos`, `return_logprob` (what an
RL rollout sends), all admitted at once, so every measured step decodes exactly B requests.

`--num-continuous-decode-steps 1,4` measures instead the CUDA engine's decode path, once per
value: the overlapped path (device-fed input ids, blocks of N decode steps per scheduler
iteration, one read-back per block). The engine takes that path where it runs Triton kernels,
which on CPU means under the Triton interpreter: run with TRITON_INTERPRET=1 (the flag is refused
without it). Every Triton kernel then runs interpreted, far slower than on a GPU; those inside
the forward and sampler spans count as device work, as on CUDA, and the host figure is the rest.
A row's host time is per decode step of the block, and per token. Without the interpreter the
CPU engine samples on the torch path, which is what the default rows measure.

`--graph-sampling on,off` (with TRITON_INTERPRET=1) runs each row once per value: `on` samples
inside the decode step's forward (the body the CUDA engine captures in its decode graph,
rltool.engine.decode_sample; run eagerly here), `off` launches the sampler after the forward
from the overlapped block (PagedRunner(graph_sampling=False)). The host figure is the host work
each path adds around the same interpreted kernels; on a GPU, benchmarks/engine_graph_sampling.py
measures wall against GPU time.

Usage: python -m benchmarks.engine_host [--batches 64,256] [--steps 64] [--repeats 3]
       [--profile N] [--out DIR]
       TRITON_INTERPRET=1 python -m benchmarks.engine_host --num-continuous-decode-steps 1,4 ...
       [--graph-sampling on,off]
Prints a table (median host µs per step over the repeats, each repeat's median over its steps)
and, last, one JSON line. --profile N prints cProfile's top N functions of the scheduler thread
(the decode steps and what surrounds them).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
from pathlib import Path

import torch

from rltool.data.models import init_model
from rltool import batch_invariant, trace
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.profile.engine_steps import decode_steps
from rltool.profile.events import read_events

from benchmarks import harness
from benchmarks.engine_common import submit_and_wait

PROMPT_LEN = 16


def run(model_dir: Path, batch: int, steps: int, *, profiler: cProfile.Profile | None,
        multistep: int | None, trace_root: Path, graph_sampling: bool = True) -> dict:
    """One traced run of `steps` decode steps at `batch`: the median wall, device and host µs per
    decode step over the steps that decoded all `batch` requests."""
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=batch,
                         max_total_tokens=batch * (PROMPT_LEN + steps + 64),
                         graph_sampling=graph_sampling)
    sched = PagedScheduler(runner, max_running=batch, max_prefill_tokens=batch * PROMPT_LEN,
                           num_continuous_decode_steps=multistep or 1)
    prompts = [[(7 * i + j) % 40 + 3 for j in range(PROMPT_LEN)] for i in range(batch)]
    folder = Path(tempfile.mkdtemp(dir=trace_root))
    trace.configure(folder, role="engine_host")
    sched.start()
    try:
        if profiler is not None:  # cProfile profiles the thread that enables it
            sched.call(profiler.enable).result()
        submit_and_wait(sched, prompts, [steps + 1] * batch, timeout_s=600)
        if profiler is not None:
            sched.call(profiler.disable).result()
    finally:
        sched.stop()
        trace.configure(None, role="engine_host")  # flushes the events
    full = [r for r in decode_steps(read_events(folder)) if r["batch"] == batch]
    assert len(full) >= steps // (4 * (multistep or 1)), \
        f"only {len(full)} decode steps decoded all {batch} requests"
    return {"steps": sum(r["steps"] for r in full),
            "host_us": statistics.median(r["host_us"] for r in full),
            "wall_us": statistics.median(r["wall_us"] for r in full),
            "device_us": statistics.median(r["device_us"] for r in full)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions")
    ap.add_argument("--num-continuous-decode-steps", default="",
                    help="comma-separated: the CUDA engine's decode path with blocks of N steps")
    ap.add_argument("--graph-sampling", default="on",
                    help="comma-separated on/off: sample inside the decode forward or after it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.num_continuous_decode_steps and not batch_invariant.INTERPRETED:
        ap.error("--num-continuous-decode-steps measures the Triton decode path: run with "
                 "TRITON_INTERPRET=1 on the CPU")
    sampling = args.graph_sampling.split(",")
    if set(sampling) - {"on", "off"}:
        ap.error(f"--graph-sampling {args.graph_sampling!r}: use on, off or on,off")
    if "off" in sampling and not args.num_continuous_decode_steps:
        ap.error("--graph-sampling off measures the overlapped decode path: add "
                 "--num-continuous-decode-steps (and TRITON_INTERPRET=1)")
    torch.set_num_threads(args.threads)
    bench = harness.Run("engine_host")
    batches = [int(b) for b in args.batches.split(",")]
    modes = ([int(n) for n in args.num_continuous_decode_steps.split(",")]
             if args.num_continuous_decode_steps else [None])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "trace").mkdir()
        model_dir = init_model(Path(tmp) / "tiny", arch="qwen2", preset="tiny", task="reverse",
                               seed=0)
        for batch, multistep, on in [(b, m, g) for m in modes for b in batches
                                     for g in sampling]:
            profiler = cProfile.Profile() if args.profile else None
            runs = [run(model_dir, batch, args.steps, profiler=profiler, multistep=multistep,
                        trace_root=Path(tmp) / "trace", graph_sampling=on == "on")
                    for _ in range(args.repeats)]
            rows.append({"batch": batch, "num_continuous_decode_steps": multistep,
                         "graph_sampling": on if multistep is not None else "-",
                         "host_us": statistics.median(r["host_us"] for r in runs),
                         "host_us_runs": [round(r["host_us"], 1) for r in runs],
                         "wall_us": statistics.median(r["wall_us"] for r in runs),
                         "device_us": statistics.median(r["device_us"] for r in runs)})
            if profiler is not None:
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
                print(text.getvalue())
    print("| N | B | graph sampling | host µs/step | host µs/token | wall µs/step | "
          "device µs/step | host runs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["num_continuous_decode_steps"]
        print(f"| {'-' if n is None else n} | {r['batch']} | {r['graph_sampling']} | "
              f"{r['host_us']:.0f} | "
              f"{r['host_us'] / r['batch']:.2f} | "
              f"{r['wall_us']:.0f} | {r['device_us']:.0f} | {r['host_us_runs']} |")
    bench.finish({"threads": args.threads, "steps": args.steps, "clock": "wall (trace spans)",
                  "triton_interpreted": batch_invariant.INTERPRETED, "rows": rows},
                 out=args.out)


if __name__ == "__main__":
    main()
