"""The order in which waiting requests start (--schedule-policy), under SGLang's names: `fcfs`,
arrival order; `lpm`, longest prefix match first: the requests whose prompts have the most tokens
in the prefix cache start first (ties in arrival order), so requests sharing a prompt prefix run
while its pages are still cached instead of after an unrelated request has evicted them.

As in SGLang, `lpm` orders at most LPM_MAX_QUEUE requests and keeps arrival order beyond that:
every step matches each candidate's tokens against the radix tree, a cost that grows with the
queue while the reuse it buys does not.
"""

from __future__ import annotations

from collections.abc import Callable

from rltool.engine.request import Request

SCHEDULE_POLICIES = ("fcfs", "lpm")
LPM_MAX_QUEUE = 128


def ordered(reqs: list[Request], policy: str, cached_length: Callable[[list[int]], int]
            ) -> list[Request]:
    """`reqs` (in arrival order) in the order they should start under `policy`;
    `cached_length(tokens)` gives the tokens of the longest cached prefix of `tokens`."""
    if policy == "fcfs" or len(reqs) < 2 or len(reqs) > LPM_MAX_QUEUE:
        return list(reqs)
    matched = {id(r): cached_length(r.all_ids()) for r in reqs}
    return sorted(reqs, key=lambda r: (-matched[id(r)], r.seq))
