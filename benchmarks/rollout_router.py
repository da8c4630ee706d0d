"""Client-side cost of the rollout router with a large backlog (rltool/rollout/router.py).

A rollout step queues every sample at once (P prompts x N samples, e.g. 512 x 16 = 8192) and the
router hands them to engines as slots free. This measures the router alone: 4 in-process engines
that answer instantly, 32 slots each, backlogs of 1k / 4k / 16k requests, unkeyed (least
outstanding) and keyed (consistent hashing). Baseline in the same run: the same router with a
wake-everyone release (what an asyncio.Condition + notify_all gives, the first version), against
the shipped one-wake-up-per-freed-slot queues. Reported: requests/s (wall) and CPU µs per
request, median of --repeats; the machine's load average is recorded (the box is shared).

Usage: .venv/bin/python benchmarks/rollout_router.py [--repeats 3] [--out FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone

from rltool.rollout.router import Engine, Router

ENGINES = 4
CONCURRENCY = 32
BACKLOGS = (1000, 4000, 16000)
TARGET_SPEEDUP_16K = 5.0  # predicted in benchmarks/NOTES.md before measuring


class InstantEngine:
    """An engine that answers at the next event-loop turn (no generation cost)."""

    async def generate(self, payload: dict, *, routing_key: str | None = None) -> dict:
        await asyncio.sleep(0)
        return {"output_ids": [], "meta_info": {}}

    async def health(self) -> bool:
        return True

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        pass

    async def aclose(self) -> None:
        pass


class WakeAllRouter(Router):
    """Baseline: every freed slot wakes every waiter, which all re-pick (a thundering herd)."""

    def _wake(self, engine: Engine) -> None:
        for queue in [e.waiting for e in self.engines] + [self._waiting]:
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)


def measure(router_cls: type[Router], *, backlog: int, keyed: bool, repeats: int) -> dict:
    rates, cpu_us = [], []
    for _ in range(repeats):
        async def run() -> None:
            router = router_cls({f"http://e{i}": InstantEngine() for i in range(ENGINES)},
                                concurrency=CONCURRENCY)
            await asyncio.gather(*(router.generate({"rid": str(i)},
                                                   routing_key=f"s{i}" if keyed else None)
                                   for i in range(backlog)))

        start, start_cpu = time.perf_counter(), time.process_time()
        asyncio.run(run())
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        rates.append(backlog / wall)
        cpu_us.append(cpu / backlog * 1e6)
    return {"req_per_s": statistics.median(rates), "cpu_us_per_req": statistics.median(cpu_us)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for keyed in (False, True):
        for backlog in BACKLOGS:
            base = measure(WakeAllRouter, backlog=backlog, keyed=keyed, repeats=args.repeats)
            new = measure(Router, backlog=backlog, keyed=keyed, repeats=args.repeats)
            rows.append({"routing": "keyed" if keyed else "unkeyed", "backlog": backlog,
                         "baseline_req_per_s": base["req_per_s"],
                         "router_req_per_s": new["req_per_s"],
                         "baseline_cpu_us_per_req": base["cpu_us_per_req"],
                         "router_cpu_us_per_req": new["cpu_us_per_req"],
                         "speedup": new["req_per_s"] / base["req_per_s"]})
    print(f"{'routing':8s} {'backlog':>7s} {'wake-all req/s':>15s} {'router req/s':>13s} "
          f"{'µs/req (cpu)':>13s} {'speedup':>8s}")
    for r in rows:
        print(f"{r['routing']:8s} {r['backlog']:7d} {r['baseline_req_per_s']:15,.0f} "
              f"{r['router_req_per_s']:13,.0f} {r['router_cpu_us_per_req']:13.1f} "
              f"{r['speedup']:7.1f}x")
    worst_16k = min(r["speedup"] for r in rows if r["backlog"] == 16000)
    result = {"benchmark": "rollout_router", "date": datetime.now(timezone.utc).isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_avg": os.getloadavg(),
              "engines": ENGINES, "concurrency": CONCURRENCY, "repeats": args.repeats,
              "rows": rows, "target_speedup_16k": TARGET_SPEEDUP_16K,
              "min_speedup_16k": worst_16k, "target_met": worst_16k >= TARGET_SPEEDUP_16K}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
