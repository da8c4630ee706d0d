"""Multi-GPU runs on one host: megatron layouts, distributed weight sync, engine scaling.

One subcommand per run; each writes OUT/multi_gpu-ITEM-DATE-DEVICE.json (atomic: date,
machine, GPU count, arguments, rows) and prints a table and, last, one JSON line. Every run also
works on the CPU (`--device cpu`: gloo process groups, the tiny models, small sizes), which checks
the code paths, not the performance.

megatron  The dense preset (--dense-preset, qwen2.5-3b on GPUs) and the tiny qwen3_moe under
          megatron layouts (--layouts, default tp2,tp2pp2,ep2,ep4), each launched with torchrun
          over TP x PP x EP local ranks (one GPU each; a layout needing more than --gpus is
          recorded as skipped; the ranks are benchmarks/multi_gpu_megatron.py). Per model a
          TP1 run first gives the reference: fp32 logprobs of --samples seeded random
          samples. Per layout: the fp32 logprobs' largest
          difference from TP1 (check: <= 1e-5); on CUDA the bf16 logprobs' largest and mean
          difference from TP1 fp32 (reported, no bound); then --steps timed train steps (after
          --warmup; bf16 on CUDA, fp32 on the CPU), each DP rank its share of the samples by the
          DP schedule: tokens/s, and on CUDA MFU = model FLOPs / step time / (--peak-tflops x
          ranks) (benchmarks/train_megatron.py's FLOP count); beside them `rltool plan`'s
          trainer memory per GPU for the layout (rltool.profile.models.trainer_memory).
sync      This process is the trainer (cuda:0) holding the bf16 weights of --sync-preset
          (qwen2.5-7b on GPUs); --engines builtin engines serve the same model, one per GPU
          (GPUs 1..N). Per repeat the weights take one simulated optimizer step
          (bf16(w + --lr x sign(noise))) and reach the engines by each method in turn; t_W per
          method, median of --repeats:
            distributed  pause -> flush_cache -> /update_weights_from_distributed per bucket of
                         --bucket-mb (the trainer broadcasts each bucket over one process group
                         with every engine: NCCL on CUDA, gloo on the CPU) -> continue;
            full         rltool.delta.publish_version writes a full version (publish_s, timed
                         apart), then /update_weights_from_disk on every engine;
            delta        publish_version writes a delta on the previous version, then
                         /pull_weights (rebuilds it in the engines' local directory) and
                         /update_weights_from_disk, as the loop's `--sync delta` does.
          Checks: every method leaves the engines serving the same weights (greedy tokens and
          their logprobs equal after each), and these differ from the previous version's.
          Beside each t_W: `rltool plan`'s prediction (rltool.profile.models.weight_sync at
          plan's default bandwidths and t0, density = the measured delta's wire / full bytes).
engines   GRPO-shaped generation (--prompts x --group random --prompt-len-token prompts,
          seeded lognormal output lengths, ignore_eos) through rltool's router over 1, 2, 4 ...
          --engines builtin engines, one per GPU: output tokens/s and the scaling efficiency
          tokens/s(k) / (k x tokens/s(1)) (target >= 0.9).
all       megatron, sync, engines in sequence, one JSON file each.

GPU host with N GPUs (from the repository root):
  python -m benchmarks.multi_gpu all --gpus N --out benchmarks/results
CPU check of the same code paths (minutes):
  python -m benchmarks.multi_gpu all --device cpu --gpus 2 --engines 2 --out /tmp/mg
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.multi_gpu_megatron import FP32_BOUND, LAYOUTS, add_step_options, launch_layout, \
    planned_memory_gib

# -- common ------------------------------------------------------------------------------------
def write_record(run: harness.Run, args: argparse.Namespace, rows: list[dict],
                 **extra: Any) -> Path:
    record = run.record({"gpus": args.gpus,
                         "args": {k: v for k, v in vars(args).items() if k != "func"}, **extra,
                         "results": rows})
    return run.write(record, args.out)


def new_run(args: argparse.Namespace, item: str) -> harness.Run:
    """One run's record: `multi_gpu-ITEM`, its file tagged with the card and the GPU count
    (`h100x4`), or `cpuN`."""
    tag = (f"{harness.device_tag('cuda')}x{args.gpus}" if args.device == "cuda"
           else harness.device_tag("cpu"))
    return harness.Run(f"multi_gpu-{item}", device=args.device, tag=tag)


def model_dir(root: Path, *, arch: str, preset: str, dtype: str, device: str) -> Path:
    from rltool.data.models import init_model

    path = root / f"{arch}-{preset}-{dtype}"
    return path if path.exists() else init_model(path, arch=arch, preset=preset, seed=0,
                                                 dtype=dtype, device=device)


def planned_t_w(model: Path, *, density: float) -> dict[str, float]:
    """`rltool plan`'s t_W per sync mode with its default assumptions (bandwidths, t0) and the
    measured delta density."""
    from rltool.profile import models
    from rltool.profile.modelcfg import load_shape
    from rltool.profile.plan import GB, PlanInputs

    x = PlanInputs(density=density)
    rows = models.weight_sync(load_shape(model), weight_bits=x.weight_bits, bandwidth_Bps={
        "tensor": x.B_tensor_GBps * GB, "distributed": x.B_distributed_GBps * GB,
        "full": x.B_full_GBps * GB}, decode_Bps=x.decode_GBps * GB, t0_s=x.t0_s,
        density=density)["rows"]
    return {r["mode"]: r["t_W_s"] for r in rows if r["mode"] in ("distributed", "full", "delta")}


# -- megatron layouts --------------------------------------------------------------------------
def run_megatron(args: argparse.Namespace, root: Path, run: harness.Run) -> Path:
    dtype = "fp32"
    families = [("qwen2", args.dense_preset, [x for x in args.layouts if not x.startswith("ep")]),
                ("qwen3_moe", "tiny", [x for x in args.layouts if x.startswith("ep")])]
    rows: list[dict] = []
    for arch, preset, layouts in families:
        if not layouts:
            continue
        model = model_dir(root, arch=arch, preset=preset, dtype=dtype, device=args.device)
        ref_layout = "tp1" if arch == "qwen2" else "ep1"
        ref_row = launch_layout(args, model, ref_layout, root, None)
        rows.append({"model": f"{arch} {preset}", **ref_row})
        ref = root / f"{model.name}.ref"
        for layout in layouts:
            need = LAYOUTS[layout][0] * LAYOUTS[layout][1] * LAYOUTS[layout][2]
            if need > args.gpus:
                row = {"layout": layout, "ranks": need,
                       "skipped": f"needs {need} GPUs, the host has {args.gpus}"}
            elif "error" in ref_row:
                row = {"layout": layout, "ranks": need, "skipped": "the TP1 reference failed"}
            else:
                row = launch_layout(args, model, layout, root, ref)
                row["plan_memory_gib"] = planned_memory_gib(model, layout,
                                                            micro_batch_tokens=args.seq_len)
                if "fp32_max_abs_diff" in row:
                    row["fp32_check"] = row["fp32_max_abs_diff"] <= FP32_BOUND
            rows.append({"model": f"{arch} {preset}", **row})
            harness.progress(json.dumps(rows[-1]))
        shutil.rmtree(model)  # disk for the next runs (the 3B fp32 model is 12 GB)
    path = write_record(run, args, rows, fp32_bound=FP32_BOUND)
    harness.print_table(["model", "layout", "ranks", "fp32 diff", "bf16 max", "bf16 mean", "tokens/s",
                 "MFU", "peak GiB", "plan GiB", "note"],
                [[r["model"], r["layout"], r["ranks"], r.get("fp32_max_abs_diff"),
                  r.get("bf16_max_abs_diff"), r.get("bf16_mean_abs_diff"), r.get("tokens_per_s"),
                  r.get("mfu"), r.get("peak_memory_gib"), r.get("plan_memory_gib"),
                  (r.get("error") or r.get("skipped") or "")[:60].replace("\n", " ")]
                 for r in rows])
    return path


# -- engines -----------------------------------------------------------------------------------
def start_engines(args: argparse.Namespace, model: Path, count: int, *, first_gpu: int,
                  logs: Path, extra: list[str] = ()) -> list[Any]:
    """`count` builtin engines, one per GPU from `first_gpu` on (on the CPU: `count` engines),
    started at the same time (from threads, so not `die_with_parent`: the parent-death signal
    follows the starting thread; the callers stop them in `finally`)."""
    from concurrent.futures import ThreadPoolExecutor

    from rltool.rollout.launch import start_engine

    def one(i: int) -> Any:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(first_gpu + i)) \
            if args.device == "cuda" else None
        return start_engine(["--engine", "builtin", "--device", args.device, "--dtype", "bf16",
                             "--model", str(model), "--log-level", "warning", *extra,
                             *args.engine_args], log_path=logs / f"engine-{first_gpu + i}.log",
                            env=env, ready_timeout_s=900)

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(one, i) for i in range(count)]
    procs = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for p in procs:
            p.stop()
        raise failed[0]
    return procs


def next_weights(named: list[tuple[str, torch.Tensor]], *, lr: float, seed: int
                 ) -> list[tuple[str, torch.Tensor]]:
    """One simulated optimizer step: bf16(float(w) + lr * sign(noise)), on the weights' device."""
    gen = torch.Generator(device=named[0][1].device).manual_seed(seed)
    return [(n, (t.float() + lr * torch.randn(t.shape, generator=gen, device=t.device).sign())
             .to(t.dtype)) for n, t in named]


async def sync_distributed(urls: list[str], named: list[tuple[str, torch.Tensor]], *,
                           device: str, bucket_bytes: int, version: str, group: list) -> float:
    """pause -> flush -> broadcast per bucket -> continue on every engine; returns seconds."""
    from rltool.delta import sync_group, tensor_sync
    from rltool.rollout.client import EngineClient
    from rltool.supervisor import free_port

    backend = "nccl" if device == "cuda" else "gloo"
    clients = [EngineClient(u, timeout_s=900) for u in urls]
    try:
        if not group:  # joined once, reused by every sync (as the loop does)
            port = free_port("127.0.0.1")
            joins = asyncio.gather(*(c.init_weights_update_group(
                master_address="127.0.0.1", master_port=port, rank_offset=i + 1,
                world_size=len(urls) + 1, backend=backend) for i, c in enumerate(clients)))
            group.append(await asyncio.to_thread(
                sync_group.join_group, master_address="127.0.0.1", master_port=port, rank=0,
                world_size=len(urls) + 1, backend=backend))
            for answer in await joins:
                assert answer["success"], answer
        start = time.perf_counter()
        await asyncio.gather(*(c.pause_generation("abort") for c in clients))
        await asyncio.gather(*(c.flush_cache() for c in clients))
        buckets = tensor_sync.buckets(named, bucket_bytes=bucket_bytes)
        for i, bucket in enumerate(buckets):
            tag = version if i == len(buckets) - 1 else None
            updates = asyncio.gather(*(c.update_weights_from_distributed(
                **tensor_sync.describe(bucket), weight_version=tag) for c in clients))
            await asyncio.to_thread(tensor_sync.broadcast, group[0], [t for _, t in bucket])
            for answer in await updates:
                assert answer["success"], answer
        await asyncio.gather(*(c.continue_generation() for c in clients))
        return time.perf_counter() - start
    finally:
        for c in clients:
            await c.aclose()


async def sync_disk(urls: list[str], path: Path, version: str, *,
                    pull: tuple[Path, Path, int] | None) -> float:
    """/update_weights_from_disk of `path` on every engine (after /pull_weights(local, source,
    version) for a delta); returns seconds."""
    from rltool.rollout.client import EngineClient

    clients = [EngineClient(u, timeout_s=900) for u in urls]
    try:
        start = time.perf_counter()
        if pull is not None:
            local, source, target = pull
            for answer in await asyncio.gather(*(c.pull_weights(
                    local_checkpoint_dir=str(local), source_dir=str(source),
                    target_version=target) for c in clients)):
                assert answer["success"], answer
            path = local
        for answer in await asyncio.gather(*(c.update_weights_from_disk(
                str(path), weight_version=version) for c in clients)):
            assert answer["success"], answer
        return time.perf_counter() - start
    finally:
        for c in clients:
            await c.aclose()


async def probe(urls: list[str], version: str | None) -> list[Any]:
    """Greedy tokens and logprobs of one prompt on every engine (which must serve `version`,
    when given)."""
    from rltool.rollout.client import EngineClient

    out = []
    for url in urls:
        async with EngineClient(url, timeout_s=900) as c:
            info = await c.get_server_info()
            assert version in (None, info["weight_version"]), (info["weight_version"], version)
            answer = await c.generate({"input_ids": list(range(10, 26)), "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                           "ignore_eos": True}})
            out.append([answer["output_ids"], answer["meta_info"]["output_token_logprobs"]])
    return out


def run_sync(args: argparse.Namespace, root: Path, run: harness.Run) -> Path:
    """Per repeat v: the next weights reach the engines by each method in turn; every method must
    leave them serving the same weights (probe answers equal)."""
    from safetensors.torch import load_file

    from rltool.delta.config import SyncConfig
    from rltool.delta.publish import publish_version
    from rltool.rundir import weight_dir_name

    model = model_dir(root, arch="qwen2", preset=args.sync_preset, dtype="bf16",
                      device=args.device)
    logs, local = root / "logs", root / "engine_local"
    logs.mkdir(exist_ok=True)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    named = sorted((n, t.to(device)) for f in sorted(model.glob("*.safetensors"))
                   for n, t in load_file(str(f)).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    dirs = {m: root / f"publish-{m}" for m in ("full", "delta")}
    # the base of the first delta (full versions need none)
    publish_version(model, SyncConfig(sync="full"), publish_dir=dirs["delta"], version=0,
                    dtype="bf16")
    procs = start_engines(args, model, args.engines, first_gpu=1, logs=logs,
                          extra=["--local-checkpoint-dir", str(local)])
    urls = [p.url for p in procs]
    group: list = []
    times: dict[str, list[float]] = {"distributed": [], "full": [], "delta": []}
    publish_s: dict[str, list[float]] = {"distributed": [], "full": [], "delta": []}
    wire: dict[str, list[int]] = {"distributed": [], "full": [], "delta": []}
    same = changed = True
    try:
        previous = asyncio.run(probe(urls, None))
        for v in range(1, args.repeats + 1):
            named = next_weights(named, lr=args.lr, seed=v)
            times["distributed"].append(asyncio.run(sync_distributed(
                urls, named, device=args.device, bucket_bytes=int(args.bucket_mb * 2**20),
                version=str(v), group=group)))
            publish_s["distributed"].append(0.0)
            wire["distributed"].append(nbytes)
            answers = [asyncio.run(probe(urls, str(v)))]
            state = {n: t.cpu() for n, t in named}
            for method, publish in dirs.items():
                metrics = publish_version(state, SyncConfig(sync=method), publish_dir=publish,
                                          version=v, source_model_dir=model, dtype="bf16")
                publish_s[method].append(metrics["perf/update_weights_time"])
                wire[method].append(metrics["perf/update_weights_wire_bytes"])
                pull = (local, publish, v) if method == "delta" else None
                times[method].append(asyncio.run(sync_disk(
                    urls, publish / weight_dir_name(v), str(v), pull=pull)))
                if method == "full":  # served now; the previous full version is not needed
                    shutil.rmtree(publish / weight_dir_name(v - 1), ignore_errors=True)
                answers.append(asyncio.run(probe(urls, str(v))))
            same = same and all(a == answers[0] for a in answers)
            changed = changed and answers[0] != previous
            previous = answers[0]
    finally:
        for p in procs:
            p.stop()
    rows = [{"method": m, "engines": args.engines, "bytes": nbytes,
             "wire_bytes": statistics.median(wire[m]), "t_W_s": statistics.median(ts),
             "t_W_s_all": ts, "GBps_per_engine": nbytes / statistics.median(ts) / 1e9,
             "publish_s": statistics.median(publish_s[m]), "same_weights_every_method": same,
             "probe_changed_every_version": changed}
            for m, ts in times.items()]
    plan = planned_t_w(model, density=min(1.0, statistics.median(wire["delta"]) / nbytes))
    for row in rows:
        row["plan_t_W_s"] = plan[row["method"]]
    path = write_record(run, args, rows, preset=args.sync_preset,
                        bucket_bytes=int(args.bucket_mb * 2**20), lr=args.lr,
                        transport="nccl" if args.device == "cuda" else "gloo")
    harness.print_table(["method", "engines", "GB", "wire GB", "t_W s", "plan t_W s", "GB/s/engine",
                 "publish s", "same"],
                [[r["method"], r["engines"], r["bytes"] / 1e9, r["wire_bytes"] / 1e9, r["t_W_s"],
                  r["plan_t_W_s"], r["GBps_per_engine"], r["publish_s"],
                  r["same_weights_every_method"]]
                 for r in rows])
    return path


async def grpo_round(urls: list[str], args: argparse.Namespace, vocab: int, *, keyed: bool,
                     cap: int) -> dict:
    """Every prompt x group request at once through the router: keyed by prompt (consistent
    hashing, a group's samples on one engine) or unkeyed (least outstanding)."""
    from engine_gpu_rl import output_lengths, random_prompts

    from rltool.rollout.client import EngineClient
    from rltool.rollout.router import Router

    prompts = random_prompts(args.prompts, args.prompt_len, vocab, seed=0)
    lengths = output_lengths(args.prompts * args.group, cap=cap, seed=0)
    router = Router({u: EngineClient(u, timeout_s=1800) for u in urls},
                    concurrency=args.concurrency)
    try:
        start = time.perf_counter()
        answers = await asyncio.gather(*(router.generate(
            {"input_ids": prompts[i // args.group], "sampling_params": {
                "max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}},
            routing_key=f"prompt-{i // args.group}" if keyed else None)
            for i, n in enumerate(lengths)))
        seconds = time.perf_counter() - start
    finally:
        await router.aclose()
    tokens = sum(len(answer["output_ids"]) for answer, _ in answers)
    assert tokens == sum(lengths), (tokens, sum(lengths))
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "requests_per_engine": [e["requests"]
                                    for e in router.stats()["engines"].values()]}


def run_engines(args: argparse.Namespace, root: Path, run: harness.Run) -> Path:
    """All engines start once; the first k of them serve each round (idle ones cost nothing on
    their own GPUs)."""
    model = model_dir(root, arch="qwen2", preset=args.engine_preset, dtype="bf16",
                      device=args.device)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    counts = sorted({k for k in (1, 2, 4, 8, args.engines) if k <= args.engines})
    rows: list[dict] = []
    procs = start_engines(args, model, args.engines, first_gpu=0, logs=logs)
    try:
        urls = [p.url for p in procs]
        for keyed in (True, False):
            for k in counts:
                asyncio.run(grpo_round(urls[:k], args, vocab, keyed=keyed, cap=8))  # warm-up
                row = {"routing": "keyed" if keyed else "unkeyed", "engines": k,
                       **asyncio.run(grpo_round(urls[:k], args, vocab, keyed=keyed,
                                                cap=args.max_new_tokens))}
                one = [r for r in rows if r["routing"] == row["routing"]]
                row["efficiency"] = row["tokens_per_s"] / (k * one[0]["tokens_per_s"]) \
                    if one else 1.0
                rows.append(row)
                harness.progress(json.dumps(row))
    finally:
        for p in procs:
            p.stop()
    path = write_record(run, args, rows, preset=args.engine_preset, target_efficiency=0.9)
    harness.print_table(["routing", "engines", "seconds", "output tokens", "tokens/s", "efficiency",
                 "requests per engine"],
                [[r["routing"], r["engines"], r["seconds"], r["output_tokens"], r["tokens_per_s"],
                  r["efficiency"], r["requests_per_engine"]] for r in rows])
    return path


RUNS = {"megatron": run_megatron, "sync": run_sync, "engines": run_engines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="item", required=True)
    for name in (*RUNS, "all"):
        p = sub.add_parser(name)
        add_step_options(p)
        p.add_argument("--out", required=True, help="directory for the results JSON")
        p.add_argument("--gpus", type=int, default=None,
                       help="GPUs to use (default: every visible one)")
        p.add_argument("--layouts", default="tp2,tp2pp2,ep2,ep4")
        p.add_argument("--dense-preset", default=None, help="default: qwen2.5-3b (tiny on cpu)")
        p.add_argument("--work-dir", default=None, help="where models and published versions "
                       "go (default: the system's temporary directory; removed at the end)")
        p.add_argument("--timeout-s", type=float, default=300.0, help="per torchrun launch")
        p.add_argument("--engines", type=int, default=None,
                       help="engines (default: sync GPUs - 1, engines all GPUs; cpu 1)")
        p.add_argument("--sync-preset", default=None, help="default: qwen2.5-7b (tiny on cpu)")
        p.add_argument("--bucket-mb", type=float, default=512.0)
        p.add_argument("--lr", type=float, default=1e-5, help="sync: the simulated step's size")
        p.add_argument("--repeats", type=int, default=2)
        p.add_argument("--engine-preset", default=None,
                       help="default: qwen2.5-0.5b (tiny on cpu)")
        p.add_argument("--prompts", type=int, default=64)
        p.add_argument("--group", type=int, default=8)
        p.add_argument("--prompt-len", type=int, default=512)
        p.add_argument("--max-new-tokens", type=int, default=2048)
        p.add_argument("--concurrency", type=int, default=256, help="requests per engine")
        p.add_argument("--engine-args", default="", help="extra `rltool serve` flags, quoted")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda but no CUDA device is visible; use --device cpu")
    if args.device == "cpu" and cuda:
        parser.error("--device cpu on a machine with CUDA: megatron uses the GPUs when they are "
                     "visible; hide them (CUDA_VISIBLE_DEVICES=) or use --device cuda")
    visible = torch.cuda.device_count() if cuda else None
    args.gpus = args.gpus or visible or 2
    if visible is not None and args.gpus > visible:
        parser.error(f"--gpus {args.gpus} but {visible} GPUs are visible; lower --gpus")
    args.layouts = [x for x in args.layouts.split(",") if x]
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown --layouts {','.join(unknown)}; choose from {','.join(LAYOUTS)}")
    small = args.device == "cpu"
    args.dense_preset = args.dense_preset or ("tiny" if small else "qwen2.5-3b")
    args.sync_preset = args.sync_preset or ("tiny" if small else "qwen2.5-7b")
    args.engine_preset = args.engine_preset or ("tiny" if small else "qwen2.5-0.5b")
    args.engine_args = args.engine_args.split()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    items = list(RUNS) if args.item == "all" else [args.item]
    paths, elapsed = {}, {}
    with tempfile.TemporaryDirectory(prefix="multi_gpu-", dir=args.work_dir) as tmp:
        for item in items:
            if item in ("sync", "engines"):
                default = 1 if small else (args.gpus - 1 if item == "sync" else args.gpus)
                engines = args.engines or default
                if args.device == "cuda" and engines + (item == "sync") > args.gpus:
                    parser.error(f"{item}: {engines} engines need more than --gpus {args.gpus}")
            else:
                engines = args.engines
            run_args = argparse.Namespace(**{**vars(args), "engines": engines})
            start = time.perf_counter()
            paths[item] = str(RUNS[item](run_args, Path(tmp), new_run(run_args, item)))
            elapsed[item] = time.perf_counter() - start
            print(f"results: {paths[item]} ({elapsed[item]:.0f} s)", flush=True)
    print(json.dumps({"benchmark": "multi_gpu", "results": paths, "elapsed_s": elapsed}))


if __name__ == "__main__":
    main()
