"""What the engine benchmark's modes share (benchmarks/engine_gpu.py): workload (a)'s shapes, its
random checkpoints and prompts, one timed batch through an in-process scheduler, the untimed
warm-up and a fresh engine, the device copy bandwidth and the kernel variants Triton compiled."""

from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams

from benchmarks import harness

PROMPT_LEN = 128
OUTPUT_LEN = 256


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (4 GiB buffers)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    harness.sync()
    bw = 2 * a.numel() * 10 / (start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return bw


def random_checkpoint(out: Path, preset: str, device: str = "cuda") -> Path:
    """A random-init bf16 checkpoint of the preset's shapes (`rltool init-model`), drawn on
    `device`: on the GPU a 7B model takes seconds, not the minutes of the CPU init."""
    from rltool.data.models import init_model

    return init_model(out, preset=preset, dtype="bf16", device=device)


def prompts_for(n: int, vocab: int, seed: int, *, length: int = PROMPT_LEN) -> list[list[int]]:
    """`n` prompts of `length` random token ids, away from the vocabulary's ends (special ids);
    a seed per prompt set, so sets of the same shapes share no prompt."""
    rng = random.Random(seed)
    lo = min(100, vocab // 4)
    return [[rng.randrange(lo, vocab - lo) for _ in range(length)] for _ in range(n)]


def submit_and_wait(sched: PagedScheduler, prompts: list[list[int]], lengths: list[int], *,
                    timeout_s: float = 1800.0, sampling: dict | None = None
                    ) -> tuple[list[Request], float]:
    """All requests at once (temperature 1, ignore_eos, logprobs, plus the `sampling` params;
    request i exactly `lengths[i]` tokens); returns them, finished, and the seconds until the
    last finished."""
    done, finished = threading.Event(), []

    def on_finish(req: Request) -> None:
        finished.append(req)
        if len(finished) == len(prompts):
            done.set()

    tag = sched.next_seq()
    reqs = [Request(rid=f"b{tag}-{i}", prompt_ids=list(p), on_finish=on_finish,
                    return_logprob=True,
                    params=SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True,
                                          **(sampling or {})))
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    t0 = time.perf_counter()
    sched.submit(reqs)
    assert done.wait(timeout_s), "engine run did not finish"
    elapsed = time.perf_counter() - t0
    bad = [r.rid for r, n in zip(reqs, lengths) if len(r.output_ids) != n]
    assert not bad, f"requests stopped before their max_new_tokens: {bad[:5]}"
    return reqs, elapsed


def run_batch(sched: PagedScheduler, prompts, *, max_new: int = OUTPUT_LEN,
              sampling: dict | None = None) -> dict:
    counters0 = counters(sched)
    reqs, elapsed = submit_and_wait(sched, prompts, [max_new] * len(prompts), timeout_s=600,
                                    sampling=sampling)
    out = sum(len(r.output_ids) for r in reqs)
    ttfts = [r.t_first_token - r.t_arrival for r in reqs]
    counts = {k: v - counters0[k] for k, v in counters(sched).items()}
    return {"seconds": elapsed, "output_tokens": out, "tokens_per_s": out / elapsed,
            "mean_ttft_s": statistics.mean(ttfts), "max_ttft_s": max(ttfts), **counts}


def counters(sched: PagedScheduler) -> dict:
    """What a run adds to: the scheduler's decode and prefill forwards and retractions, the CUDA
    caching allocator's retries (a cudaMalloc that failed, so the cache was freed and the
    allocation tried again: a stall of the whole device), and the kernel variants in Triton's
    cache directory (each compile writes one; a compile stalls the engine for ~1 s)."""
    retries = (torch.cuda.memory_stats().get("num_alloc_retries", 0)
               if torch.cuda.is_available() else 0)
    return {"decode_steps": sched.num_decode_forwards,
            "prefill_forwards": sched.num_prefill_forwards,
            "retractions": sched.num_retractions, "alloc_retries": retries,
            "kernels_compiled": len(compiled_kernels())}


def compiled_kernels() -> set[str]:
    """The kernel variants in Triton's cache directory: "name@hash" of each."""
    import triton

    root = Path(triton.knobs.cache.dir)
    return {f"{meta.stem}@{meta.parent.name[:6]}" for meta in root.glob("*/*.json")
            if not meta.name.startswith("__grp__")}


def warm_up(sched: PagedScheduler, batches: list[int], vocab: int) -> None:
    """Each batch size's prefill once, untimed, with 2 output tokens and other prompts than the
    timed ones (the prefix cache holds none of those): no timed run compiles kernels for its
    prefill shapes, whichever engine of a process meets them first."""
    for b in batches:
        run_batch(sched, prompts_for(b, vocab, 1_000 + b), max_new=2)


@contextlib.contextmanager
def fresh_engine(model_dir: Path, batches: list[int], *, deterministic: bool = False,
                 kv_cache_dtype: str = "auto", **runner_options):
    """A fresh in-process engine with workload (a)'s settings (`runner_options`: more
    PagedRunner arguments), (runner, started scheduler); stopped and its memory released on
    exit."""
    runner = PagedRunner(model_dir, device="cuda", dtype="bf16", max_running=max(batches),
                         cuda_graph_max_bs=max(batches), deterministic=deterministic,
                         kv_cache_dtype=kv_cache_dtype, **runner_options)
    sched = PagedScheduler(runner, max_running=max(batches), max_prefill_tokens=16384,
                           chunked_prefill_size=8192, deterministic=deterministic)
    sched.start()
    try:
        yield runner, sched
    finally:
        sched.stop()
        runner.release()
        del runner, sched
        torch.cuda.empty_cache()


def in_process(model_dir: Path, batches: list[int], *, deterministic: bool = False,
               kv_cache_dtype: str = "auto") -> dict:
    """Workload (a) in process on a fresh engine, after an untimed warm-up of each batch size:
    {batch: run_batch result}, plus what the engine holds under "engine" (weight bytes and
    precision, KV bytes per token, pool tokens)."""
    with fresh_engine(model_dir, batches, deterministic=deterministic,
                      kv_cache_dtype=kv_cache_dtype) as (runner, sched):
        warm_up(sched, batches, runner.vocab_size)
        out: dict = {b: run_batch(sched, prompts_for(b, runner.vocab_size, 3 + b))
                     for b in batches}
        out["engine"] = {"weight_bytes": runner.model.nbytes(), **runner.weight_info,
                         "kv_bytes_per_token": runner.kv_bytes_per_token,
                         "kv_pool_tokens": runner.max_total_num_tokens}
    return out


def checkpoints(preset: str) -> tuple[Path, Path]:
    """A random-init bf16 checkpoint of the preset and its `rltool convert fp8` version."""
    from rltool.convert.fp8 import Fp8Config, quantize_checkpoint

    model_dir = random_checkpoint(Path(tempfile.mkdtemp()) / preset, preset)
    fp8_dir = model_dir.parent / f"{preset}-fp8"
    quantize_checkpoint(Fp8Config(hf=model_dir, out=fp8_dir, workers=8))
    return model_dir, fp8_dir


def first_batches(model_dir: Path, batches: list[int], repeats: int, label: str, *,
                  profile_first: bool = False) -> list[dict]:
    """The warm-up, then each batch size `repeats` times, on a fresh engine: a row per run.
    `profile_first`: each batch size's first run runs under torch.profiler (its row's
    `profile`: rltool.profile.torch_trace.profiled, whose longest device idle gaps name the
    kernel that waited), the figures of that run including the profiler's overhead."""
    from rltool.profile.torch_trace import profiled

    rows = []
    with fresh_engine(model_dir, batches) as (runner, sched):
        runs = [("warm-up", 0, lambda: warm_up(sched, batches, runner.vocab_size) or {})]
        runs += [(f"B={b} #{i + 1}", b, lambda b=b, i=i: run_batch(
            sched, prompts_for(b, runner.vocab_size, 3 + b + 1000 * i)))
            for b in batches for i in range(repeats)]
        for name, batch, fn in runs:
            before = compiled_kernels()
            profile = None
            if profile_first and name.endswith(" #1"):
                box: dict = {}
                profile = profiled(lambda fn=fn: box.update(fn()))
                result = box
            else:
                result = fn()
            new = sorted(compiled_kernels() - before)
            rows.append({"engine": label, "run": name, "batch": batch, **result,
                         "compiled": new, **({"profile": profile} if profile else {})})
            shown = {k: round(v, 3) for k, v in result.items()
                     if k in ("seconds", "tokens_per_s", "mean_ttft_s", "max_ttft_s")}
            print(f"{label:5} {name:12} {shown} compiled {len(new)}: {new}", flush=True)
    return rows
