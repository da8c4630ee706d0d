"""Routing quality of rltool's router against a plain least-outstanding client and smg's policies.

The same workloads go, over HTTP, to the same simulated engines in the same run:
- rltool: `rltool.rollout.router.Router` straight to the engines (least outstanding, chosen when a
  slot frees; keyed requests by consistent hashing);
- least-outstanding round robin: the plain client design, one asyncio.Semaphore for all slots and
  the engine with the fewest requests in flight (ties rotate), keys ignored;
- smg (the `smg` gateway, installed with the dev extra) with each of its single-pool policies, the
  rollout client in front of it as rltool runs it behind `--router` (keys travel as
  X-SMG-Routing-Key).

Simulated engine (`--serve-engine`, one process each): `SLOTS` requests run at once, more wait
in its queue; a request costs prefill of its uncached prompt tokens plus decode of its output
tokens (asyncio sleeps, so the routing and HTTP costs are real and the model costs are fixed); a
prefix cache per engine of `CACHE_TOKENS` tokens (LRU over conversations) makes a later turn of a
conversation cheap only on the engine that served the earlier turn. One engine runs at half
speed, as a busier or older node would. /v1/loads reports queue depth for smg's load-aware
policies.

Workloads: "single" (independent requests, long-tail output lengths: balancing) and "multi-turn"
(conversations of several turns with the conversation id as routing key: cache affinity).
Reported per router: makespan, mean latency, prefix-cache hit rate; median of --repeats, routers
interleaved within each repeat.

Usage: python -m benchmarks.router_policies [--repeats 3] [--out DIR_OR_FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import shutil
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

import httpx
import numpy as np

from rltool.supervisor import Child, free_port, start

from benchmarks import harness

SLOTS = 8
SPEEDS = (1.0, 1.0, 1.0, 0.5)
PREFILL_MS_PER_TOKEN = 0.25
DECODE_MS_PER_TOKEN = 2.0
CACHE_TOKENS = 24_000
SMG_POLICIES = ("round_robin", "random", "power_of_two", "least_load", "cache_aware",
                "consistent_hashing", "prefix_hash")


# ----- simulated engine --------------------------------------------------------------------------

def serve_engine(port: int, speed: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    slots = asyncio.Semaphore(SLOTS)
    cache: OrderedDict[tuple, list[int]] = OrderedDict()  # conversation head -> cached tokens
    state = {"running": 0, "waiting": 0, "cached_total": 0}

    def cached_prefix(ids: list[int]) -> int:
        seq = cache.get(tuple(ids[:4]))
        if seq is None:
            return 0
        n = 0
        for a, b in zip(seq, ids):
            if a != b:
                break
            n += 1
        return n

    def remember(ids: list[int]) -> None:
        key = tuple(ids[:4])
        cache.pop(key, None)
        cache[key] = ids
        state["cached_total"] = sum(len(s) for s in cache.values())
        while state["cached_total"] > CACHE_TOKENS and len(cache) > 1:
            _, dropped = cache.popitem(last=False)
            state["cached_total"] -= len(dropped)

    async def generate(request):
        body = await request.json()
        ids = body["input_ids"]
        new = int(body["sampling_params"]["max_new_tokens"])
        state["waiting"] += 1
        async with slots:
            state["waiting"] -= 1
            state["running"] += 1
            hit = cached_prefix(ids)
            cost_ms = ((len(ids) - hit) * PREFILL_MS_PER_TOKEN + new * DECODE_MS_PER_TOKEN) / speed
            await asyncio.sleep(cost_ms / 1e3)
            out = [7] * new
            remember(ids + out)
            state["running"] -= 1
        return JSONResponse({"text": "", "output_ids": out, "meta_info": {
            "id": body.get("rid"), "finish_reason": {"type": "length", "length": new},
            "prompt_tokens": len(ids), "completion_tokens": new, "cached_tokens": hit,
            "output_token_logprobs": [], "weight_version": "0"}})

    async def ok(request):
        return Response(status_code=200)

    async def info(request):
        return JSONResponse({"model_path": "sim", "served_model_name": "sim", "tp_size": 1,
                             "dp_size": 1, "is_generation": True, "max_req_input_len": 1 << 20})

    async def loads(request):
        return JSONResponse({"loads": [{"dp_rank": 0, "num_running_reqs": state["running"],
                                        "num_waiting_reqs": state["waiting"],
                                        "token_usage": state["running"] / SLOTS,
                                        "gen_throughput": 0.0}]})

    routes = [Route("/generate", generate, methods=["POST"]), Route("/health", ok),
              Route("/health_generate", ok), Route("/v1/loads", loads)]
    routes += [Route(p, info) for p in ("/get_model_info", "/model_info", "/get_server_info",
                                        "/server_info")]
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=port, log_level="warning",
                access_log=False)


# ----- workloads ---------------------------------------------------------------------------------

def workloads(seed: int) -> dict[str, list[list[dict]]]:
    """Each workload is a list of conversations; a conversation is a list of turns run in order
    (a single-turn workload has one turn per conversation). A turn: new prompt tokens, output
    tokens. Conversation c's tokens start with a head unique to c."""
    rng = np.random.default_rng(seed)
    single = [[{"prompt": int(rng.integers(100, 400)),
                "output": int(min(8 + rng.pareto(1.1) * 20, 400))}] for _ in range(256)]
    multi = [[{"prompt": int(rng.integers(200, 600) if t == 0 else rng.integers(20, 60)),
               "output": int(rng.integers(20, 80))} for t in range(4)] for _ in range(64)]
    return {"single": single, "multi-turn": multi}


class LeastOutstanding:
    """Plain least-outstanding round robin: one semaphore for every slot; once a slot is free the
    request goes to the engine with the fewest in flight, ties rotating."""

    def __init__(self, clients: dict, *, concurrency: int):
        self.clients = clients
        self.active = {url: 0 for url in clients}
        self.slots = asyncio.Semaphore(concurrency * len(clients))
        self.turn = itertools.count()

    async def generate(self, payload: dict, *, routing_key: str | None = None):
        async with self.slots:
            least = min(self.active.values())
            tied = [u for u, n in self.active.items() if n == least]
            url = tied[next(self.turn) % len(tied)]
            self.active[url] += 1
            try:
                return await self.clients[url].generate(payload), url
            finally:
                self.active[url] -= 1

    async def aclose(self) -> None:
        for c in self.clients.values():
            await c.aclose()


async def drive(router, convs: list[list[dict]], *, keyed: bool) -> dict:
    latencies, hit, prompt = [], 0, 0

    async def conversation(c: int, turns: list[dict]) -> None:
        nonlocal hit, prompt
        head = turns[0]["head"]
        ids = [head // 256 + 1, head % 256 + 1, 3, 4]
        for t, turn in enumerate(turns):
            ids = ids + [5] * turn["prompt"]
            payload = {"input_ids": ids, "rid": f"c{c}-t{t}",
                       "sampling_params": {"max_new_tokens": turn["output"]}}
            t0 = time.perf_counter()
            out, _ = await router.generate(payload, routing_key=f"conv-{head}" if keyed else None)
            latencies.append(time.perf_counter() - t0)
            meta = out["meta_info"]
            hit += meta["cached_tokens"]
            prompt += meta["prompt_tokens"]
            ids = ids + out["output_ids"]

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c, turns) for c, turns in enumerate(convs)))
    return {"makespan_s": time.perf_counter() - t0, "mean_latency_s": statistics.mean(latencies),
            "p90_latency_s": float(np.percentile(latencies, 90)), "cache_hit_rate": hit / prompt}


def start_smg(engine_urls: list[str], policy: str, log_path: Path) -> tuple[Child, str]:
    smg = shutil.which("smg", path=str(Path(sys.executable).parent))
    if smg is None:
        raise SystemExit("smg not found next to this python: install the dev extra")
    port = free_port()
    child = start([smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", *engine_urls, "--policy", policy,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--log-level", "warn"], log_path=log_path, name=f"smg --policy {policy}")
    url = f"http://127.0.0.1:{port}"

    def routes() -> bool:  # ready when it routes a request
        with contextlib.suppress(httpx.HTTPError):
            return httpx.post(url + "/generate", timeout=10, json={
                "input_ids": [9, 9, 9, 9], "sampling_params": {"max_new_tokens": 1}}
            ).status_code == 200
        return False

    child.wait_until(routes, timeout_s=60, what="routing requests", poll_s=0.3)
    return child, url


def run_all(args) -> list[dict]:
    from rltool.rollout.client import EngineClient
    from rltool.rollout.router import Router

    log_path = Path(args.log)
    engines, urls = [], []
    for speed in SPEEDS:
        port = free_port()
        engines.append(start([sys.executable, "-m", "benchmarks.router_policies", "--serve-engine",
                              str(port), str(speed)],
                             log_path=log_path, name="simulated engine"))
        urls.append(f"http://127.0.0.1:{port}")
    rows = []
    try:
        for url, child in zip(urls, engines):
            child.wait_healthy(url, "/health", timeout_s=60)

        def client(url):
            return EngineClient(url, timeout_s=120.0, max_retries=0)

        async def one(name: str, make, convs, keyed: bool) -> dict:
            router = make()
            try:
                return await drive(router, convs, keyed=keyed)
            finally:
                await router.aclose()

        makers = {
            "rltool": lambda: Router({u: client(u) for u in urls}, concurrency=SLOTS),
            "least-outstanding": lambda: LeastOutstanding({u: client(u) for u in urls},
                                                          concurrency=SLOTS),
        }
        gateways = {}
        for policy in SMG_POLICIES:
            child, url = start_smg(urls, policy, log_path)
            gateways[policy] = child
            makers[f"smg {policy}"] = (lambda url=url: Router(
                {url: client(url)}, concurrency=SLOTS * len(urls), via_gateway=True))
        try:
            for rep in range(args.repeats):
                for wname, convs in workloads(seed=rep).items():
                    keyed = wname == "multi-turn"
                    for name, make in makers.items():
                        # Empty the engines' caches between runs: restart-free, new heads.
                        res = asyncio.run(one(name, make, _shift(convs, rep, name), keyed))
                        rows.append({"repeat": rep, "workload": wname, "router": name, **res})
                        print(f"{rep} {wname:10s} {name:24s} makespan {res['makespan_s']:6.2f}s "
                              f"mean {res['mean_latency_s']:.3f}s hit {res['cache_hit_rate']:.3f}",
                              flush=True)
        finally:
            for child in gateways.values():
                child.stop()
    finally:
        for child in engines:
            child.stop()
    return rows


_RUN_IDS = itertools.count(1)


def _shift(convs: list[list[dict]], rep: int, name: str) -> list[list[dict]]:
    """Same turns; a fresh conversation-head offset per run so no run reuses another's cache
    entries (the heads are what the simulated cache keys on)."""
    offset = next(_RUN_IDS) * 1000
    return [[dict(t, head=offset + c) for t in turns] for c, turns in enumerate(convs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve-engine", nargs=2, metavar=("PORT", "SPEED"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log", default="/tmp/router_policies.log")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.serve_engine:
        serve_engine(int(args.serve_engine[0]), float(args.serve_engine[1]))
        return
    run = harness.Run("router_policies")
    rows = run_all(args)
    summary = []
    for wname in ("single", "multi-turn"):
        for name in dict.fromkeys(r["router"] for r in rows):
            sel = [r for r in rows if r["workload"] == wname and r["router"] == name]
            summary.append({"workload": wname, "router": name, **{
                k: statistics.median(r[k] for r in sel)
                for k in ("makespan_s", "mean_latency_s", "p90_latency_s", "cache_hit_rate")}})
    print(f"{'workload':10s} {'router':24s} {'makespan s':>10s} {'mean s':>7s} {'p90 s':>6s} "
          f"{'hit':>6s}")
    for s in summary:
        print(f"{s['workload']:10s} {s['router']:24s} {s['makespan_s']:10.2f} "
              f"{s['mean_latency_s']:7.3f} {s['p90_latency_s']:6.3f} {s['cache_hit_rate']:6.3f}")
    run.finish({"engines": {"speeds": SPEEDS, "slots": SLOTS, "cache_tokens": CACHE_TOKENS,
                          "prefill_ms_per_token": PREFILL_MS_PER_TOKEN,
                          "decode_ms_per_token": DECODE_MS_PER_TOKEN},
                "repeats": args.repeats, "summary": summary, "rows": rows}, out=args.out)


if __name__ == "__main__":
    main()
