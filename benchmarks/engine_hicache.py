"""The builtin engine's host KV tier (`--enable-hierarchical-cache`) on a multi-turn workload
whose shared histories exceed the device pool, against the same engine without the tier, in one
run.

Workload: C conversations of T turns on a random-init checkpoint (FULL: the Qwen2.5-0.5B
shapes in bf16; QUICK: the `small` preset in fp32). Conversation c opens with S system tokens of
its own; turn t sends the history (system, then each earlier turn's U user tokens and R reply
tokens) and the turn's U user tokens, for one output token (greedy), so a request's latency is
its time to first token. The replies are scripted (drawn with the prompts, not the engine's
output), so both engines get the same tokens. Turns go round the conversations (turn 1 of every
conversation, then turn 2, ...) one request at a time, alternating engines request by request
(so load drifts reach both alike). The device pool is capped with --max-total-tokens far below
the C histories, so by the time a conversation comes back its history has been evicted: the
baseline prefills it again, the tiered engine reloads it from host memory.

Arms (two `rltool serve` engines serving side by side, each warmed up on other prompts and
flushed first):
  baseline   the prefix cache alone
  tiered     --enable-hierarchical-cache, a host pool large enough for every history
Per arm: median and p99 time to first token (the client's request latency), the engine's mean
TTFT, prompt+output tokens per second of request time, prefix hits per tier. For the tiered
arm: bytes reloaded per second of reload copy time against a pinned host-to-device copy measured
here (CUDA), and the hits after a weight update (a disk sync of the same checkpoint; any hit
makes the exit code 1). Then `rltool plan`'s HiCache check (rltool.profile.serving_check) on the
two engines' counters over the workload: its prediction of the saving per request against the
measured difference of mean TTFT.

Usage: python -m benchmarks.engine_hicache [--device cuda] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness


@dataclass(frozen=True)
class Workload:
    preset: str
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    new_tokens: int
    pool_tokens: int  # --max-total-tokens of both engines

    @property
    def history_tokens(self) -> int:
        """The last turn's prompt."""
        return (self.system_tokens + (self.turns - 1) * (self.user_tokens + self.reply_tokens)
                + self.user_tokens)


# 64 conversations x 8 turns over ~2k-token histories on Qwen2.5-0.5B's shapes: 129k history
# tokens against a 16k-token device pool.
FULL = Workload("qwen2.5-0.5b", conversations=64, turns=8, system_tokens=1024, user_tokens=96,
                reply_tokens=32, new_tokens=1, pool_tokens=16384)
QUICK = Workload("small", conversations=6, turns=3, system_tokens=384, user_tokens=32,
                 reply_tokens=16, new_tokens=1, pool_tokens=768)
WARM_UP_REQUESTS = 4
AFTER_UPDATE_REQUESTS = 4


def conversation_prompts(w: Workload, *, vocab: int, seed: int) -> list[list[list[int]]]:
    """prompts[c][t]: conversation c's prompt at turn t (its history, then the turn's user
    tokens); token ids away from the vocabulary's ends (special ids)."""
    rng = random.Random(seed)
    lo = min(100, vocab // 4)

    def draw(n: int) -> list[int]:
        return [rng.randrange(lo, vocab - lo) for _ in range(n)]

    out = []
    for _ in range(w.conversations):
        history, turns = draw(w.system_tokens), []
        for _ in range(w.turns):
            user = draw(w.user_tokens)
            turns.append(history + user)
            history = history + user + draw(w.reply_tokens)
        out.append(turns)
    return out


def _payload(prompt: list[int], new_tokens: int) -> dict[str, Any]:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens,
                                                     "temperature": 0.0, "ignore_eos": True}}


async def run_workload(clients: dict[str, Any], prompts: list[list[list[int]]], *,
                       new_tokens: int) -> dict[str, dict[str, Any]]:
    """Send every turn to each engine (role -> EngineClient), one request at a time, turns
    round the conversations, engines alternating; per role: the request latencies, tokens and
    cached tokens."""
    import time

    roles = list(clients)
    out: dict[str, dict[str, Any]] = {r: {"latency_s": [], "tokens": 0, "cached_tokens": 0}
                                      for r in roles}
    turns = len(prompts[0]) if prompts else 0
    i = 0
    for t in range(turns):
        for conversation in prompts:
            prompt = conversation[t]
            order = roles if i % 2 == 0 else roles[::-1]
            i += 1
            for role in order:
                t0 = time.perf_counter()
                answer = await clients[role].generate(_payload(prompt, new_tokens))
                out[role]["latency_s"].append(time.perf_counter() - t0)
                meta = answer["meta_info"]
                out[role]["tokens"] += meta["prompt_tokens"] + meta["completion_tokens"]
                out[role]["cached_tokens"] += meta["cached_tokens"]
    return out


def pinned_bandwidth() -> float | None:
    """Pinned host -> device copy, bytes per second (256 MiB, CUDA events); None on the CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dev.copy_(host, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    bandwidth = 10 * host.numel() / (start.elapsed_time(end) / 1e3)
    del host, dev
    torch.cuda.empty_cache()  # the engines share the card
    return bandwidth


def engine_args(model: Path, w: Workload, *, device: str, tiered: bool) -> list[str]:
    args = ["--engine", "builtin", "--model", str(model), "--device", device,
            "--max-total-tokens", str(w.pool_tokens)]
    if device == "cpu":
        args += ["--num-threads", "1"]
    else:  # two engines share the card; a few graphs are enough one request at a time
        args += ["--mem-fraction-static", "0.3", "--cuda-graph-max-bs", "8"]
    if tiered:
        # Room on the host for every history, whatever the device pool keeps.
        ratio = math.ceil(w.conversations * w.history_tokens / w.pool_tokens) + 1
        args += ["--enable-hierarchical-cache", "--hicache-ratio", str(ratio)]
    return args


async def measure(model: Path, w: Workload, urls: dict[str, str], *, vocab: int
                  ) -> dict[str, Any]:
    from rltool.profile.serving_check import counters_since, hicache_check
    from rltool.rollout.client import EngineClient

    clients = {r: EngineClient(u, timeout_s=600.0, max_retries=0) for r, u in urls.items()}
    try:
        warm = conversation_prompts(Workload(w.preset, WARM_UP_REQUESTS, 1, w.system_tokens,
                                             w.user_tokens, 0, w.new_tokens, w.pool_tokens),
                                    vocab=vocab, seed=1)
        await run_workload(clients, warm, new_tokens=w.new_tokens)
        for c in clients.values():
            await c.flush_cache()
        before = {r: await c.get_server_info() for r, c in clients.items()}
        harness.progress(f"workload: {w.conversations} conversations x {w.turns} turns, "
                         f"histories up to {w.history_tokens} tokens, pool {w.pool_tokens}")
        prompts = conversation_prompts(w, vocab=vocab, seed=2)
        sent = await run_workload(clients, prompts, new_tokens=w.new_tokens)
        after = {r: await c.get_server_info() for r, c in clients.items()}
        runs = {r: counters_since(before[r], after[r]) for r in clients}
        check = hicache_check(runs["tiered"], runs["baseline"], model=model)
        harness.progress("weight update on the tiered engine, then the last turns again")
        tiered = clients["tiered"]
        await tiered.update_weights_from_disk(str(model))
        again = [[c[-1]] for c in prompts[:AFTER_UPDATE_REQUESTS]]
        replay = await run_workload({"tiered": tiered}, again, new_tokens=w.new_tokens)
        final = counters_since(after["tiered"], await tiered.get_server_info())["hicache"]
    finally:
        for c in clients.values():
            await c.aclose()
    rows = {}
    for role in clients:
        lat, stats = sent[role]["latency_s"], runs[role]["hicache"]
        rows[role] = {
            "arm": role, "requests": len(lat),
            "median_ttft_s": statistics.median(lat),
            "p99_ttft_s": sorted(lat)[max(math.ceil(0.99 * len(lat)) - 1, 0)],
            "ttft_mean_s": stats["ttft_mean_s"],
            "tokens_per_s": sent[role]["tokens"] / sum(lat),
            "cached_tokens": sent[role]["cached_tokens"],
            "device_hit_tokens": stats["device_hit_tokens"],
            "host_hit_tokens": stats["host_hit_tokens"],
            "prefill_tokens": stats["prefill_tokens"],
            "prefill_s_per_token": stats["prefill_s_per_token"],
            "bytes_to_host": stats["bytes_to_host"], "bytes_to_device": stats["bytes_to_device"],
            "io_to_device_s": stats["io_to_device_s"],
            "reload_bytes_per_s": (stats["bytes_to_device"] / stats["io_to_device_s"]
                                   if stats["io_to_device_s"] else None)}
    return {"rows": rows, "check": check.as_dict(),
            "after_update": {"requests": len(replay["tiered"]["latency_s"]),
                             "cached_tokens": replay["tiered"]["cached_tokens"],
                             "host_hit_tokens": final["host_hit_tokens"],
                             "device_hit_tokens": final["device_hit_tokens"]}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    return harness.parse_quick_workload(
        argv, name="engine_hicache", doc=__doc__,
        quick_help=f"The smoke workload ({QUICK.conversations} conversations x {QUICK.turns} "
                   f"turns on the {QUICK.preset} preset)")


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_or_report(parse, argv)
    if args is None:
        return 2
    from rltool.data.models import init_model
    from rltool.engine.model_spec import read_spec
    from rltool.rollout.launch import start_engine

    w = QUICK if args.quick else FULL
    run = harness.Run("engine_hicache", device=args.device)
    root = Path(tempfile.mkdtemp(prefix="engine_hicache-"))
    harness.progress(f"random {w.preset} checkpoint")
    model = init_model(root / w.preset, preset=w.preset,
                       dtype="bf16" if args.device == "cuda" else "fp32", device=args.device)
    vocab = read_spec(model).vocab_size
    bandwidth = pinned_bandwidth() if args.device == "cuda" else None
    engines = {}
    try:
        for role in ("baseline", "tiered"):
            harness.progress(f"starting the {role} engine")
            engines[role] = start_engine(engine_args(model, w, device=args.device,
                                                     tiered=role == "tiered"),
                                         log_path=root / f"{role}.log", ready_timeout_s=300.0)
        result = asyncio.run(measure(model, w, {r: e.url for r, e in engines.items()},
                                     vocab=vocab))
    except BaseException:
        harness.progress(f"the engines' logs are in {root}")
        raise
    finally:
        for e in engines.values():
            e.stop()
    shutil.rmtree(root)  # the checkpoint (1 GB for the full workload) and the engine logs
    rows, check = result["rows"], result["check"]
    base, tier = rows["baseline"], rows["tiered"]
    harness.print_table(
        ["arm", "TTFT p50 s", "TTFT p99 s", "engine TTFT mean s", "tok/s", "device hits", "host hits",
         "reload GB/s"],
        [[r["arm"], r["median_ttft_s"], r["p99_ttft_s"], r["ttft_mean_s"],
          r["tokens_per_s"], r["device_hit_tokens"], r["host_hit_tokens"],
          r["reload_bytes_per_s"] / 1e9 if r["reload_bytes_per_s"] else None]
         for r in rows.values()])
    print(f"plan check: predicted saving {check['predicted']['value'] * 1e3:.3f} ms/request, "
          f"measured {check['measured']['value'] * 1e3:.3f} ms "
          f"({check['relative_error']:+.1%}, tolerance {check['tolerance']:.0%})",
          file=sys.stderr)
    fields = {
        "quick": args.quick, "workload": w.__dict__, "history_tokens": w.history_tokens,
        "pinned_h2d_bytes_per_s": bandwidth,
        "reload_fraction_of_pinned": (tier["reload_bytes_per_s"] / bandwidth
                                      if bandwidth and tier["reload_bytes_per_s"] else None),
        "median_ttft_ratio": tier["median_ttft_s"] / base["median_ttft_s"],
        "ttft_mean_ratio": tier["ttft_mean_s"] / base["ttft_mean_s"],
        "throughput_ratio": tier["tokens_per_s"] / base["tokens_per_s"],
        "rows": list(rows.values()), "after_update": result["after_update"],
        "plan_check": check}
    run.finish(fields, out=args.out)
    stale = result["after_update"]
    if stale["host_hit_tokens"] or stale["device_hit_tokens"] or stale["cached_tokens"]:
        print(f"Error: the tiered engine served {stale['cached_tokens']} cached tokens computed "
              "under the weights before the update", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
