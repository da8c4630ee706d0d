"""slime's DP schedule, written from its description, as a baseline for benchmarks/dp_schedule.py.

slime plans a training step in three moves (its `--balance-data` and `--use-dynamic-batch-size`
options, the configuration its examples run with):
1. split the step's samples over the DP ranks with Karmarkar-Karp (largest differencing) into
   dp_size parts of equal sample count; here the weight is each sample's FLOPs (a*L + b*L^2), the
   same cost model rltool's schedule balances, so both sides optimise the same objective;
2. on each rank count micro-batches by first-fit over the rank's samples in order under the token
   cap, and take the largest count over the ranks (an all-reduce MAX in slime), so ranks step in
   lockstep;
3. on each rank split its samples into that many micro-batches with Karmarkar-Karp on tokens
   (parts of any size). Nothing re-checks the cap afterwards, so a micro-batch can exceed it;
   `overfull_microbatches` counts those.
"""

from __future__ import annotations

import heapq
import itertools

from rltool.train.dp_schedule import Plan, sample_flops


def karmarkar_karp(weights: list[float], *, parts: int, equal_size: bool) -> list[list[int]]:
    """Largest differencing into `parts` parts; with `equal_size` the part sizes differ by at most
    one item. Ties go to the lower index, so the result is deterministic."""
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_size:
        seeds = [order[start:start + parts] for start in range(0, len(order), parts)]
    else:
        seeds = [[i] for i in order]
    tick = itertools.count()
    heap = []
    for seed in seeds:
        state = [(weights[i], [i]) for i in seed] + [(0.0, []) for _ in range(parts - len(seed))]
        state.sort(key=lambda p: p[0], reverse=True)
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), next(tick), state))
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # The heaviest part of one state takes the lightest part of the other.
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        merged.sort(key=lambda p: p[0], reverse=True)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tick), merged))
    if not heap:
        return [[] for _ in range(parts)]
    return [sorted(items) for _, items in heap[0][2]]


def first_fit_count(lengths: list[int], *, cap: int) -> int:
    """Micro-batches first-fit needs for `lengths` in the given order (a sample over the cap opens
    a micro-batch of its own)."""
    bins: list[int] = []
    for n in lengths:
        for b, used in enumerate(bins):
            if used + n <= cap:
                bins[b] += n
                break
        else:
            bins.append(n)
    return len(bins)


def slime_schedule(lengths: list[int], *, dp_size: int, max_tokens_per_microbatch: int) -> Plan:
    flops = [sample_flops(n) for n in lengths]
    ranks = karmarkar_karp(flops, parts=dp_size, equal_size=True)
    count = max(max(first_fit_count([lengths[i] for i in rank], cap=max_tokens_per_microbatch)
                    for rank in ranks), 1)
    plan: Plan = []
    for rank in ranks:
        mbs = karmarkar_karp([float(lengths[i]) for i in rank], parts=count, equal_size=False)
        plan.append([[rank[j] for j in mb] for mb in mbs])
    return plan


def overfull_microbatches(lengths: list[int], plan: Plan, *, cap: int) -> int:
    """Micro-batches of more than one sample whose tokens exceed the cap."""
    return sum(1 for rank in plan for mb in rank
               if len(mb) > 1 and sum(lengths[i] for i in mb) > cap)
