"""Client-side cost of the rollout router with a large backlog (rltool/rollout/router.py).

A rollout step queues every sample at once (P prompts x N samples, e.g. 512 x 16 = 8192) and the
router hands them to engines as slots free. This measures the router alone: 4 in-process engines
that answer instantly, 32 slots each, backlogs of 1k / 4k / 16k requests, unkeyed (least
outstanding) and keyed (consistent hashing). Baselines in the same run, interleaved repeat by
repeat: a plain least-outstanding round-robin client (one asyncio.Semaphore for every slot, the
engine with the fewest in flight; benchmarks/router_policies.py, unkeyed only: it has no keyed
mode) and the same router with a wake-everyone release (an asyncio.Condition + notify_all, the
naive design), against the shipped one-wake-up-per-freed-slot queues. Routing quality against
smg's policies is benchmarks/router_policies.py. Reported: requests/s (wall) and CPU µs per
request, median of --repeats; the machine's load average is recorded (the box is shared).

Usage: python -m benchmarks.rollout_router [--repeats 3] [--out DIR_OR_FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from rltool.rollout.router import Engine, Router
from benchmarks import harness
from benchmarks.router_policies import LeastOutstanding

ENGINES = 4
CONCURRENCY = 32
BACKLOGS = (1000, 4000, 16000)
TARGET_SPEEDUP_16K = 5.0  # predicted before measuring


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


def measure(routers: dict, *, backlog: int, keyed: bool, repeats: int) -> dict:
    rates = {name: [] for name in routers}
    cpu_us = {name: [] for name in routers}
    for _ in range(repeats):
        for name, router_cls in routers.items():
            async def run() -> None:
                router = router_cls({f"http://e{i}": InstantEngine() for i in range(ENGINES)},
                                    concurrency=CONCURRENCY)
                await asyncio.gather(*(router.generate({"rid": str(i)},
                                                       routing_key=f"s{i}" if keyed else None)
                                       for i in range(backlog)))

            start, start_cpu = time.perf_counter(), time.process_time()
            asyncio.run(run())
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            rates[name].append(backlog / wall)
            cpu_us[name].append(cpu / backlog * 1e6)
    return {name: {"req_per_s": statistics.median(rates[name]),
                   "cpu_us_per_req": statistics.median(cpu_us[name])} for name in routers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = harness.Run("rollout_router")
    rows = []
    for keyed in (False, True):
        for backlog in BACKLOGS:
            routers = {"wake_all": WakeAllRouter, "router": Router}
            if not keyed:
                routers = {"least_outstanding": LeastOutstanding, **routers}
            got = measure(routers, backlog=backlog, keyed=keyed, repeats=args.repeats)
            row = {"routing": "keyed" if keyed else "unkeyed", "backlog": backlog}
            for name, res in got.items():
                row[f"{name}_req_per_s"] = res["req_per_s"]
                row[f"{name}_cpu_us_per_req"] = res["cpu_us_per_req"]
            row["speedup"] = row["router_req_per_s"] / row["wake_all_req_per_s"]
            if not keyed:
                row["speedup_vs_least_outstanding"] = (row["router_req_per_s"]
                                                       / row["least_outstanding_req_per_s"])
            rows.append(row)
    print(f"{'routing':8s} {'backlog':>7s} {'LOR req/s':>10s} {'wake-all req/s':>15s} "
          f"{'router req/s':>13s} {'µs/req (cpu)':>13s} {'vs wake-all':>12s} {'vs LOR':>7s}")
    for r in rows:
        has_lor = "speedup_vs_least_outstanding" in r
        lor = f"{r['least_outstanding_req_per_s']:,.0f}" if has_lor else "-"
        vs_lor = f"{r['speedup_vs_least_outstanding']:.2f}x" if has_lor else "-"
        print(f"{r['routing']:8s} {r['backlog']:7d} {lor:>10s} {r['wake_all_req_per_s']:15,.0f} "
              f"{r['router_req_per_s']:13,.0f} {r['router_cpu_us_per_req']:13.1f} "
              f"{r['speedup']:11.1f}x {vs_lor:>7s}")
    worst_16k = min(r["speedup"] for r in rows if r["backlog"] == 16000)
    run.finish({"engines": ENGINES, "concurrency": CONCURRENCY, "repeats": args.repeats,
              "rows": rows, "target_speedup_16k": TARGET_SPEEDUP_16K,
              "min_speedup_16k": worst_16k, "target_met": worst_16k >= TARGET_SPEEDUP_16K}, out=args.out)


if __name__ == "__main__":
    main()
