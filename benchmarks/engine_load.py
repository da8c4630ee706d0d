"""Load test of the builtin engine on loopback: C concurrent clients for a fixed time (and at
most a fixed number of requests), a mix of well-formed requests, streams the client drops after
the first event, bodies over --max-request-bytes and malformed bodies. A queue kept small
(--max-queued-requests) makes the engine refuse some requests with 429 (a stream: an error
event with code 429 after its 200).

Checks (exit 1 when one fails): no 5xx; no leaked request slots (/v1/loads: running and waiting
counts back to 0 once the clients stop); the engine's resident memory after warm-up (the first
quarter of the run) stays within 10% of its value at the end of warm-up. Reports p50/p99 latency
of the well-formed requests, status counts (429s included) and the memory samples.

Example (about a minute on 2 cores):
  python -m benchmarks.engine_load --clients 32 --seconds 40 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from benchmarks import harness

MAX_REQUEST_BYTES = 64 * 1024
MIX = (("ok", 0.7), ("stream_drop", 0.1), ("oversize", 0.1), ("malformed", 0.1))


def pick(rng: random.Random) -> str:
    x, acc = rng.random(), 0.0
    for kind, p in MIX:
        acc += p
        if x < acc:
            return kind
    return MIX[0][0]


async def one(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random) -> int:
    body = {"text": "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8))),
            "sampling_params": {"max_new_tokens": rng.randint(1, 24), "temperature": 1.0}}
    if kind == "ok":
        return (await client.post(url + "/generate", json=body)).status_code
    if kind == "stream_drop":
        async with client.stream("POST", url + "/generate", json=body | {"stream": True}) as r:
            async for chunk in r.aiter_raw():
                # A stream answers 200 and carries a refusal as an error event (SGLang's way).
                if r.status_code == 200 and b'"code": 429' in chunk:
                    return "200+429-event"
                break  # drop the connection after the first event
            return r.status_code
    if kind == "oversize":
        big = {"text": "1" * (MAX_REQUEST_BYTES + 1024), "sampling_params": {}}
        return (await client.post(url + "/generate", json=big)).status_code
    bad = rng.choice([b"{", b"[]", b'{"text": 5}', b'{"sampling_params": {"max_new_tokens": -1}}',
                      b"\xff\xfe", b'{"text": "a", "sampling_params": {"top_p": 7}}'])
    return (await client.post(url + "/generate", content=bad,
                              headers={"Content-Type": "application/json"})).status_code


async def drive(url: str, *, clients: int, seconds: float, max_requests: int, seed: int,
                pid: int) -> dict:
    statuses: Counter = Counter()
    by_kind: Counter = Counter()
    latencies: list[float] = []
    rss: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    sent = 0
    proc = psutil.Process(pid)

    async def client_loop(i: int) -> None:
        nonlocal sent
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=120) as client:
            while time.perf_counter() - t0 < seconds and sent < max_requests:
                sent += 1
                kind = pick(rng)
                start = time.perf_counter()
                try:
                    code = await one(client, url, kind, rng)
                except httpx.HTTPError as e:
                    code = f"client:{type(e).__name__}"
                statuses[str(code)] += 1
                by_kind[f"{kind}:{code}"] += 1
                if kind == "ok" and code == 200:
                    latencies.append(time.perf_counter() - start)

    async def sample_rss() -> None:
        while time.perf_counter() - t0 < seconds:
            rss.append((round(time.perf_counter() - t0, 2), proc.memory_info().rss))
            await asyncio.sleep(0.5)

    await asyncio.gather(sample_rss(), *(client_loop(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    latencies.sort()

    def pct(q: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 1) \
            if latencies else None

    return {"requests": sent, "wall_s": round(wall, 1), "statuses": dict(statuses),
            "by_kind": dict(by_kind), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "ok_per_s": round(len(latencies) / wall, 1), "rss": rss}


def drained(url: str, *, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        load = httpx.get(url + "/v1/loads", timeout=10).json()["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 \
                or time.monotonic() > deadline:
            return load
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--max-requests", type=int, default=20000)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--max-queued", type=int, default=8, help="Small, so 429s happen.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from rltool.data.models import init_model
    from rltool.rollout.launch import start_engine

    run = harness.Run("engine_load")
    with tempfile.TemporaryDirectory(prefix="rltool-engine-load-") as tmp:
        model = init_model(Path(tmp) / "tiny", arch="qwen2", preset="tiny", task="copy", seed=0)
        engine = start_engine(["--engine", "builtin", "--model", str(model), "--num-threads", "1",
                               "--max-running-requests", str(args.max_running),
                               "--max-queued-requests", str(args.max_queued),
                               "--max-request-bytes", str(MAX_REQUEST_BYTES)],
                              log_path=Path(tmp) / "engine.log")
        try:
            r = asyncio.run(drive(engine.url, clients=args.clients, seconds=args.seconds,
                                  max_requests=args.max_requests, seed=args.seed,
                                  pid=engine.pid))
            load = drained(engine.url)
            alive = httpx.post(engine.url + "/generate", json={"text": "1"}, timeout=30)
        finally:
            engine.stop()
    warm = [b for t, b in r["rss"] if t >= args.seconds / 4]
    base = warm[0] if warm else 0
    drift = max(abs(b - base) / base for b in warm) if base else None
    r5xx = sum(n for code, n in r["statuses"].items() if code.startswith("5"))
    refused = sum(n for code, n in r["statuses"].items() if "429" in code)
    checks = {"no_5xx": r5xx == 0,
              "slots_returned": load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0,
              "rss_within_10pct_after_warmup": drift is not None and drift <= 0.10,
              "serving_after": alive.status_code == 200}
    result = {"settings": vars(args) | {"max_request_bytes": MAX_REQUEST_BYTES,
                                        "mix": dict(MIX)},
              **{k: v for k, v in r.items() if k != "rss"},
              "count_429": refused, "count_5xx": r5xx,
              "rss_mib_after_warmup": {"first": round(base / 2**20, 1),
                                       "min": round(min(warm) / 2**20, 1),
                                       "max": round(max(warm) / 2**20, 1)} if warm else None,
              "rss_max_drift_frac": round(drift, 4) if drift is not None else None,
              "loads_after": load, "checks": checks}
    print(f"{'clients':>7s} {'requests':>8s} {'ok/s':>6s} {'p50_ms':>7s} {'p99_ms':>7s} "
          f"{'429':>5s} {'5xx':>4s} {'rss_drift':>9s}")
    print(f"{args.clients:>7d} {r['requests']:>8d} {r['ok_per_s']:>6.1f} {r['p50_ms']!s:>7s} "
          f"{r['p99_ms']!s:>7s} {result['count_429']:>5d} {r5xx:>4d} "
          f"{result['rss_max_drift_frac']!s:>9s}")
    return run.finish(result, out=args.out, detail={"rss_samples": r["rss"]})


if __name__ == "__main__":
    sys.exit(0 if all(main()["checks"].values()) else 1)
