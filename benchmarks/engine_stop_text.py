"""Stop-string checks of one long output on the CPU: the incremental check (`StopText`: decode
the tokens since the last whole characters, search the new text) against decoding and searching
the whole output at every token, over the same tokens, with the stop string at the end.

Prints a table (tokens given to tokenizer.decode, seconds) and one JSON line; `--out` also
writes the JSON. Exit 1 if the two checks decide differently.

Example:
  python -m benchmarks.engine_stop_text --tokens 4000 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks import harness

STOP = "</answer>"
WORDS = ["the", "sum", "is", "x", "=", "12", "+", "(", ")", "so", "then", "we", "get", "\n", ","]


class Counting:
    """A tokenizer whose decode calls add up the tokens they are given."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces
        self.tokens = 0

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.tokens += len(ids)
        return self.tokenizer.decode(ids, **kw)


def check_all(rule: Any, ids: list[int], text: Callable[[int], tuple[str, int]]) -> Any:
    """Check every token as the scheduler does; the step and decision that stopped it."""
    for n in range(1, len(ids) + 1):
        stop = rule.reason(n, ids[n - 1], lambda: text(n))
        if stop is not None:
            return n, stop
    return None


def main() -> None:
    from rltool.data.tokenizer import build_tokenizer
    from rltool.engine.loading import load_tokenizer
    from rltool.engine.sampling import SamplingParams
    from rltool.engine.stop_rule import StopRule, StopText

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000, help="Output length in tokens.")
    parser.add_argument("--out", default=None, help="Write the JSON result here too.")
    args = parser.parse_args()
    if args.tokens < 2 * len(STOP):
        parser.error(f"--tokens must be >= {2 * len(STOP)} (the output ends with {STOP!r})")
    run = harness.Run("engine_stop_text")
    with tempfile.TemporaryDirectory(prefix="rltool-stop-text-") as tmp:
        build_tokenizer(tmp)
        tokenizer = load_tokenizer(tmp)
    rng = random.Random(0)
    tail = tokenizer.encode(STOP, add_special_tokens=False)
    ids: list[int] = []
    while len(ids) < args.tokens - len(tail):
        ids += tokenizer.encode(rng.choice(WORDS) + " ", add_special_tokens=False)
    ids = ids[:args.tokens - len(tail)] + tail
    stop = tokenizer.decode(tail)
    rule = StopRule.for_request(SamplingParams(max_new_tokens=len(ids), stop=[stop]),
                                prompt_len=1, eos_token_ids=[], context_length=len(ids) + 1)
    rows, decisions = [], []
    for case in ("whole text", "incremental"):
        counting = Counting(tokenizer)
        incremental = StopText(counting, True)

        def whole(n: int) -> tuple[str, int]:
            return counting.decode(ids[:n], skip_special_tokens=True), 0

        def new(n: int) -> tuple[str, int]:
            return incremental.read(ids[:n])

        harness.progress(f"{case}: {len(ids)} tokens")
        t0 = time.perf_counter()
        decisions.append(check_all(rule, ids, whole if case == "whole text" else new))
        rows.append({"case": case, "decoded_tokens": counting.tokens,
                     "seconds": round(time.perf_counter() - t0, 3)})
    harness.print_table(["case", "decoded_tokens", "seconds"],
                        [[r["case"], r["decoded_tokens"], r["seconds"]] for r in rows])
    same = decisions[0] == decisions[1] and decisions[0] is not None
    run.finish({"tokens": len(ids), "stop": stop, "same_decision": same, "results": rows,
                "speedup": round(rows[0]["seconds"] / max(rows[1]["seconds"], 1e-9), 1)},
               out=args.out)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
