"""The DP schedule: which samples each data-parallel rank processes, in which micro-batches.

One plan serves both the logprob recompute and the training step, so both see identical
micro-batches. A plan is `plan[rank][microbatch] -> [sample index, ...]`.

Rules a plan follows:
- every sample index appears exactly once;
- every rank has the same number of micro-batches (ranks step in lockstep: a rank with fewer
  micro-batches would otherwise wait in the gradient all-reduce);
- a micro-batch holds at most `max_tokens_per_microbatch` tokens, except a sample longer than the
  cap, which is a micro-batch of its own;
- a micro-batch is empty only when there are fewer samples than micro-batches needed.

How (pack first, distribute second):
1. Pack: best-fit decreasing under the token cap. The number of micro-batches M is the bin count
   rounded up to a multiple of `dp_size` (not bins split afterwards). The M - B spare bins are
   filled with the smallest samples taken out of shared bins, so bins range from full to tiny: that
   spread is what lets step 2 pair a heavy bin with light ones.
2. Distribute: balanced largest differencing (Karmarkar-Karp with equal cardinality) on bin FLOPs,
   FLOPs(sample) = a*L + b*L^2 (linear layers + causal attention; packed sequences do not attend
   across samples, so a bin's FLOPs is the sum over its samples).
   A second candidate with the same micro-batch count is built rank first (heaviest sample to the
   lightest rank with room, best fit among its micro-batches) and kept when its heaviest rank is
   lighter: on heavy tails a rank holding a huge sample must get only tiny micro-batches besides
   it, which bins packed beforehand cannot offer.
3. Refine: bounded local search (swap two micro-batches, move or swap single samples) between the
   heaviest rank and the lightest ones while the caps allow it and the maximum rank FLOPs drops.

The micro-batch count is always the minimum that best-fit decreasing reaches (rounded to dp_size):
packing comes first. On very heavy tails that can leave the imbalance above its floor where one
more micro-batch per rank would reach it (docs/benchmarks.md has the numbers).

Deterministic: ties are broken by sample index, so the same lengths give the same plan.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

Plan = list[list[list[int]]]

# Relative FLOPs per sample a*L + b*L^2. Forward+backward of a dense model costs ~6N per token
# (linear layers) plus ~6*n_layers*d_model*L per token for causal attention, so b/a is about
# n_layers*d_model/N: 28*3584/7.6e9 ~ 1.3e-5 for a 7B model, 28*1536/1.5e9 ~ 2.9e-5 for 1.5B.
DEFAULT_FLOPS_A = 1.0
DEFAULT_FLOPS_B = 2e-5

# Rooms and bin ids travel as one int (room << _SHIFT | id): bisect on ints is much faster than on
# tuples, and the pack is the hot loop.
_SHIFT = 32
_MASK = (1 << _SHIFT) - 1

_REFINE_MAX_ROUNDS = 256
# Each round tries only the few lightest ranks as partners: enough in practice, and it bounds the
# cost of a round when the heaviest rank cannot shed anything.
_REFINE_CANDIDATES = 8
# Refinement stops once the heaviest rank is this close to its floor (mean rank FLOPs, or the
# largest sample's FLOPs when that is higher): the last 0.1% is not worth the scheduling time.
_REFINE_TOLERANCE = 1e-3


def sample_flops(length: int, *, flops_a: float = DEFAULT_FLOPS_A,
                 flops_b: float = DEFAULT_FLOPS_B) -> float:
    return flops_a * length + flops_b * length * length


def schedule(lengths: list[int], *, dp_size: int, max_tokens_per_microbatch: int,
             flops_a: float = DEFAULT_FLOPS_A, flops_b: float = DEFAULT_FLOPS_B) -> Plan:
    """Plan micro-batches for `dp_size` ranks; see the module docstring for the rules.

    lengths: tokens per sample (prompt + response), each >= 1.
    Returns plan[rank][microbatch] = sample indices. With no samples every rank gets no
    micro-batches.
    """
    _check(lengths, dp_size=dp_size, max_tokens_per_microbatch=max_tokens_per_microbatch,
           flops_a=flops_a, flops_b=flops_b)
    if not lengths:
        return [[] for _ in range(dp_size)]
    flops = [sample_flops(n, flops_a=flops_a, flops_b=flops_b) for n in lengths]
    cap = max_tokens_per_microbatch
    bins = _pack(lengths, cap=cap, dp_size=dp_size)
    bin_flops = [sum(flops[i] for i in b) for b in bins]
    ranks = _balanced_kk(bin_flops, dp_size=dp_size)
    plan = [[bins[j] for j in rank] for rank in ranks]
    greedy = _greedy_plan(lengths, flops, cap=cap, dp_size=dp_size,
                          per_rank=len(bins) // dp_size)
    if greedy is not None and _max_rank_flops(greedy, flops) < _max_rank_flops(plan, flops):
        plan = greedy
    _refine(plan, lengths, flops, cap=cap)
    # Heaviest micro-batch first inside each rank: the peak memory shows up at the first step.
    return [sorted(rank, key=lambda mb: (-sum(lengths[i] for i in mb), mb[:1])) for rank in plan]


def round_robin(lengths: list[int], *, dp_size: int, max_tokens_per_microbatch: int) -> Plan:
    """The naive baseline: sample i goes to rank i % dp_size, each rank fills micro-batches in order
    up to the cap (next-fit), and ranks with fewer micro-batches are padded with empty ones."""
    _check(lengths, dp_size=dp_size, max_tokens_per_microbatch=max_tokens_per_microbatch)
    plan: Plan = []
    for r in range(dp_size):
        mbs: list[list[int]] = []
        used = 0
        for i in range(r, len(lengths), dp_size):
            if not mbs or used + lengths[i] > max_tokens_per_microbatch:
                mbs.append([])
                used = 0
            mbs[-1].append(i)
            used += lengths[i]
        plan.append(mbs)
    count = max(len(mbs) for mbs in plan)
    return [mbs + [[] for _ in range(count - len(mbs))] for mbs in plan]


@dataclass(frozen=True)
class ScheduleStats:
    num_microbatches_per_rank: int
    flops_imbalance: float  # max rank FLOPs / mean rank FLOPs
    flops_imbalance_floor: float  # max(1, largest sample FLOPs / mean rank FLOPs)
    packing_efficiency: float  # tokens / (micro-batches * cap)
    packing_efficiency_ceiling: float  # the same with the fewest micro-batches any plan could have


def schedule_stats(lengths: list[int], plan: Plan, *, max_tokens_per_microbatch: int,
                   flops_a: float = DEFAULT_FLOPS_A,
                   flops_b: float = DEFAULT_FLOPS_B) -> ScheduleStats:
    """Quality of a plan. The packing ceiling uses a lower bound on the number of bins (oversize
    samples alone; samples over half the cap cannot share; total tokens / cap), rounded up to a
    multiple of dp_size: no plan under the equal-count rule can have fewer micro-batches."""
    dp_size = len(plan)
    cap = max_tokens_per_microbatch
    _check(lengths, dp_size=dp_size, max_tokens_per_microbatch=cap, flops_a=flops_a,
           flops_b=flops_b)
    flops = [sample_flops(n, flops_a=flops_a, flops_b=flops_b) for n in lengths]
    rank_flops = [sum(flops[i] for mb in rank for i in mb) for rank in plan]
    mean_flops = sum(rank_flops) / dp_size
    count = max((len(rank) for rank in plan), default=0)
    tokens = sum(lengths)
    if not lengths:
        return ScheduleStats(count, 1.0, 1.0, 0.0, 0.0)
    return ScheduleStats(
        num_microbatches_per_rank=count,
        flops_imbalance=max(rank_flops) / mean_flops,
        flops_imbalance_floor=max(1.0, max(flops) / mean_flops),
        packing_efficiency=tokens / (count * dp_size * cap),
        packing_efficiency_ceiling=tokens / (_min_microbatches(lengths, cap=cap, dp_size=dp_size)
                                             * cap),
    )


def _check(lengths: list[int], *, dp_size: int, max_tokens_per_microbatch: int,
           flops_a: float = DEFAULT_FLOPS_A, flops_b: float = DEFAULT_FLOPS_B) -> None:
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    if any(n < 1 for n in lengths):
        raise ValueError("every sample length must be >= 1")
    if flops_a < 0 or flops_b < 0 or flops_a + flops_b <= 0:
        raise ValueError(f"FLOPs coefficients must be >= 0 and not both 0, got a={flops_a}, "
                         f"b={flops_b}")


def _min_microbatches(lengths: list[int], *, cap: int, dp_size: int) -> int:
    oversize = sum(1 for n in lengths if n > cap)
    rest = [n for n in lengths if n <= cap]
    over_half = sum(1 for n in rest if 2 * n > cap)
    bound = oversize + max(math.ceil(sum(rest) / cap), over_half)
    return dp_size * max(1, math.ceil(bound / dp_size))


def _pack(lengths: list[int], *, cap: int, dp_size: int) -> list[list[int]]:
    """Best-fit decreasing into B bins, then M = dp_size * ceil(B / dp_size) bins with no empty one
    while there are samples to spare (the smallest samples move out of shared bins)."""
    bins: list[list[int]] = []
    free: list[int] = []  # room left << _SHIFT | bin id, sorted: bisect finds the best fit
    for i in _longest_first(lengths):
        n = lengths[i]
        if n > cap:
            bins.append([i])
            continue
        k = bisect.bisect_left(free, n << _SHIFT)
        if k == len(free):
            bins.append([i])
            bisect.insort(free, (cap - n) << _SHIFT | (len(bins) - 1))
        else:
            packed = free.pop(k)
            b = packed & _MASK
            bins[b].append(i)
            bisect.insort(free, ((packed >> _SHIFT) - n) << _SHIFT | b)
    spare = dp_size * math.ceil(len(bins) / dp_size) - len(bins)
    if spare:
        # Samples in shared bins, smallest first; bins were filled in decreasing order, so the
        # last member of a bin is its smallest.
        movable = sorted(((lengths[b[-1]], b[-1], j) for j, b in enumerate(bins) if len(b) > 1))
        heapq.heapify(movable)
        for _ in range(spare):
            if not movable:
                bins.append([])
                continue
            _, i, j = heapq.heappop(movable)
            bins[j].pop()
            bins.append([i])
            if len(bins[j]) > 1:
                heapq.heappush(movable, (lengths[bins[j][-1]], bins[j][-1], j))
    return bins


def _greedy_plan(lengths: list[int], flops: list[float], *, cap: int, dp_size: int,
                 per_rank: int) -> Plan | None:
    """The rank-first alternative to pack-then-distribute, with the same micro-batch count:
    heaviest sample first, to the lightest rank that has room for it (best fit among that rank's
    micro-batches; an oversize sample needs an empty one). Wins on heavy tails, where a rank
    holding a huge sample must get only tiny micro-batches besides it. None when a sample finds
    no room anywhere (this order packs worse than best-fit decreasing)."""
    plan: Plan = [[[] for _ in range(per_rank)] for _ in range(dp_size)]
    # Per rank, sorted: room left << _SHIFT | micro-batch index.
    rooms = [[cap << _SHIFT | b for b in range(per_rank)] for _ in range(dp_size)]
    rank_flops = [0.0] * dp_size
    heap = [(0.0, r) for r in range(dp_size)]  # ranks by FLOPs
    # Ranks too full for the current sample wait here by their largest room. Samples come longest
    # first, so the room needed never grows: a parked rank returns once a sample fits it.
    parked: list[tuple[int, int]] = []  # (-largest room, rank)
    for i in _longest_first(lengths):
        need = min(lengths[i], cap)  # oversize: only an empty micro-batch (room == cap) will do
        while parked and -parked[0][0] >= need:
            _, r = heapq.heappop(parked)
            heapq.heappush(heap, (rank_flops[r], r))
        while heap:
            r = heap[0][1]
            if rooms[r][-1] >> _SHIFT >= need:
                break
            heapq.heappop(heap)
            heapq.heappush(parked, (-(rooms[r][-1] >> _SHIFT), r))
        else:
            return None
        packed = rooms[r].pop(bisect.bisect_left(rooms[r], need << _SHIFT))
        room, b = packed >> _SHIFT, packed & _MASK
        plan[r][b].append(i)
        if lengths[i] < room:
            bisect.insort(rooms[r], (room - lengths[i]) << _SHIFT | b)
        rank_flops[r] += flops[i]
        if rooms[r]:
            heapq.heapreplace(heap, (rank_flops[r], r))
        else:
            heapq.heappop(heap)
    _fill_empty(plan, lengths)
    return plan


def _fill_empty(plan: Plan, lengths: list[int]) -> None:
    """Give each empty micro-batch the smallest sample of a shared micro-batch, from its own rank
    when it has one (rank FLOPs unchanged), else from any rank. Stops when no bin is shared."""
    for rank in plan:
        for b, mb in enumerate(rank):
            if mb:
                continue
            shared = [(lengths[x[-1]], k) for k, x in enumerate(rank) if len(x) > 1]
            source = rank
            if not shared:
                shared = [(lengths[x[-1]], k, r) for r, other in enumerate(plan)
                          for k, x in enumerate(other) if len(x) > 1]
                if not shared:
                    return
                _, k, r = min(shared)
                source = plan[r]
            else:
                _, k = min(shared)
            rank[b] = [source[k].pop()]


def _longest_first(lengths: list[int]) -> list[int]:
    # sorted() stays stable with reverse=True: equal lengths keep index order (determinism).
    return sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)


def _max_rank_flops(plan: Plan, flops: list[float]) -> float:
    return max(sum(flops[i] for mb in rank for i in mb) for rank in plan)


def _balanced_kk(weights: list[float], *, dp_size: int) -> list[list[int]]:
    """Largest differencing with equal cardinality: split len(weights) items (a multiple of
    dp_size) into dp_size groups of equal size, minimising the heaviest group.

    Items sorted by weight are cut into tuples of dp_size consecutive items (one per group); the two
    partial solutions with the largest spread are merged, heaviest group of one with lightest of the
    other, until one is left."""
    order = sorted(range(len(weights)), key=lambda j: (-weights[j], j))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for t in range(0, len(order), dp_size):
        groups = [(weights[j], [j]) for j in order[t:t + dp_size]]
        heap.append((-(groups[0][0] - groups[-1][0]), t, groups))
    heapq.heapify(heap)
    tick = len(order)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[k][0] + b[-1 - k][0], a[k][1] + b[-1 - k][1]) for k in range(dp_size)]
        merged.sort(key=lambda g: (-g[0], g[1]))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tick, merged))
        tick += 1
    return [members for _, members in heap[0][2]]


def _refine(plan: Plan, lengths: list[int], flops: list[float], *, cap: int) -> None:
    """Lower the heaviest rank by an exchange with one of the lightest ranks: swap two whole
    micro-batches, move one sample, or swap two samples, under the caps. Each accepted step
    strictly lowers the pair's maximum, so the loop cannot cycle."""
    rank_flops = [sum(flops[i] for mb in rank for i in mb) for rank in plan]
    good_enough = (1 + _REFINE_TOLERANCE) * max(sum(rank_flops) / len(plan), max(flops))
    for _ in range(_REFINE_MAX_ROUNDS):
        hi = rank_flops.index(max(rank_flops))
        if rank_flops[hi] <= good_enough:
            return
        # nsmallest is stable, so ties go to the lower rank: deterministic.
        for lo in heapq.nsmallest(_REFINE_CANDIDATES, range(len(plan)),
                                  key=rank_flops.__getitem__):
            if rank_flops[lo] >= rank_flops[hi]:
                return
            step = _best_exchange(plan[hi], plan[lo], lengths, flops, cap=cap,
                                  gap=rank_flops[hi] - rank_flops[lo])
            if step is not None:
                delta = _apply(step, plan[hi], plan[lo], flops)
                rank_flops[hi] -= delta
                rank_flops[lo] += delta
                break
        else:
            return


def _best_exchange(hi: list[list[int]], lo: list[list[int]], lengths: list[int],
                   flops: list[float], *, cap: int, gap: float):
    """The exchange whose FLOPs shift from `hi` to `lo` is closest to gap/2 while in (0, gap):
    that strictly lowers max(hi, lo). Steps are (kind, hi bin, hi pos, lo bin, lo pos)."""
    target = gap / 2
    best = None
    best_err = target  # accept only shifts with |shift - gap/2| < gap/2, i.e. 0 < shift < gap
    # Whole micro-batches: big shifts in one step, caps untouched.
    lo_bins = sorted((sum(flops[i] for i in mb), b) for b, mb in enumerate(lo))
    lo_bin_keys = [f for f, _ in lo_bins]
    for hb, mb in enumerate(hi):
        fh = sum(flops[i] for i in mb)
        k = bisect.bisect_left(lo_bin_keys, fh - target)
        for kk in (k - 1, k):
            if 0 <= kk < len(lo_bins) and abs(fh - lo_bins[kk][0] - target) < best_err:
                best, best_err = ("bins", hb, -1, lo_bins[kk][1], -1), abs(fh - lo_bins[kk][0]
                                                                           - target)
    room_lo = [cap - sum(lengths[i] for i in mb) for mb in lo]
    if max(room_lo, default=0) <= 0:
        # FLOPs grow with length, so moving FLOPs to `lo` at sample level needs room there.
        return best
    load_hi = [sum(lengths[i] for i in mb) for mb in hi]
    lo_items = sorted((flops[i], i, b) for b, mb in enumerate(lo) for i in mb)
    lo_keys = [f for f, _, _ in lo_items]
    move_to = max(range(len(lo)), key=lambda b: (room_lo[b], -b))
    for hb, mb in enumerate(hi):
        for pos, i in enumerate(mb):
            if lengths[i] > cap:
                continue
            if len(mb) > 1 and lengths[i] <= room_lo[move_to]:
                err = abs(flops[i] - target)
                if err < best_err:
                    best, best_err = ("move", hb, pos, move_to, -1), err
            # Swap: want flops[j] ~ flops[i] - target; look at the neighbours in sorted order.
            k = bisect.bisect_left(lo_keys, flops[i] - target)
            for kk in (k - 2, k - 1, k, k + 1):
                if not 0 <= kk < len(lo_items):
                    continue
                fj, j, lb = lo_items[kk]
                err = abs(flops[i] - fj - target)
                if err >= best_err or lengths[j] > cap:
                    continue
                if (load_hi[hb] - lengths[i] + lengths[j] <= cap
                        and lengths[i] - lengths[j] <= room_lo[lb]):
                    best, best_err = ("swap", hb, pos, lb, lo[lb].index(j)), err
    return best


def _apply(step, hi: list[list[int]], lo: list[list[int]], flops: list[float]) -> float:
    kind, hb, pos, lb, lpos = step
    if kind == "bins":
        hi[hb], lo[lb] = lo[lb], hi[hb]
        return sum(flops[i] for i in lo[lb]) - sum(flops[i] for i in hi[hb])
    i = hi[hb][pos]
    if kind == "move":
        hi[hb].pop(pos)
        lo[lb].append(i)
        return flops[i]
    j = lo[lb][lpos]
    hi[hb][pos], lo[lb][lpos] = j, i
    return flops[i] - flops[j]
