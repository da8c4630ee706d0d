"""When a request stops: its stop tokens (EOS unless ignore_eos, plus stop_token_ids), its length
limit (max_new_tokens, capped by what is left of the context), min_new_tokens, and its stop strings
and patterns. Built once at admission; `may_stop` is the per-token test of the decode loop (a few
comparisons), `reason` the decision and the finish reason SGLang reports.

Stop strings are checked on new text only: `StopText` decodes the tokens since the last whole
characters (`StreamedText`), and each string is searched from `len(stop) - 1` characters before
the text that is new since the previous check (an earlier match would have stopped the request
then). Patterns are searched in the whole text: a regular expression's match may start anywhere
before the new text (`a.*b`) or depend on what follows it (`a(?=b)`, `$`). They run on the
scheduler thread, so a request's searches share a time budget (`PATTERN_BUDGET_S`, the `regex`
module's timeout): a pattern that backtracks without bound ends its own request with a 400
instead of stalling every request of the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import regex

from rltool.engine.detokenize import StreamedText

PATTERN_BUDGET_S = 0.25  # a request's stop_regex searches, all of them over its whole output


class PatternTimeout(Exception):
    """A request's stop_regex searches used up their time budget."""


class Patterns:
    """A request's compiled stop_regex patterns and what is left of its search budget."""

    __slots__ = ("compiled", "left_s")

    def __init__(self, patterns: Iterable[str]):
        self.compiled = tuple(regex.compile(p) for p in patterns)
        self.left_s = PATTERN_BUDGET_S

    def __bool__(self) -> bool:
        return bool(self.compiled)

    def first(self, text: str) -> tuple[int, int, str] | None:
        """(start, length, pattern) of the earliest match in `text` (the first pattern's at a
        tie); PatternTimeout once the budget is spent."""
        best: tuple[int, int, str] | None = None
        for pattern in self.compiled:
            start = time.perf_counter()
            try:
                m = pattern.search(text, timeout=max(self.left_s, 1e-6))
            except TimeoutError:
                self.left_s = 0.0
                raise PatternTimeout(pattern.pattern) from None
            self.left_s -= time.perf_counter() - start
            if m is not None and (best is None or m.start() < best[0]):
                best = (m.start(), len(m.group(0)), pattern.pattern)
        return best


@dataclass(frozen=True, slots=True)
class StopRule:
    stop_ids: frozenset[int]  # tokens that stop the request once min_new_tokens are out
    max_new_tokens: int  # the output length that stops it: its max_new_tokens or the context left
    min_new_tokens: int  # neither stop tokens nor stop strings count before this many tokens
    strings: tuple[str, ...] = ()
    patterns: Patterns | None = None  # regular expressions, searched in the output text
    keep_matched: bool = False  # no_stop_trim: the matched stop string stays in the text
    checks_text: bool = False  # any strings or patterns: every token needs the text checked

    @classmethod
    def for_request(cls, params: Any, *, prompt_len: int, eos_token_ids: Iterable[int],
                    context_length: int) -> "StopRule":
        """The rule of a request with these SamplingParams and a prompt of `prompt_len` tokens."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        return cls(stop_ids=frozenset(stop_ids),
                   max_new_tokens=min(params.max_new_tokens, context_length - prompt_len),
                   min_new_tokens=params.min_new_tokens, strings=tuple(params.stop),
                   patterns=Patterns(params.stop_regex) if params.stop_regex else None,
                   keep_matched=params.no_stop_trim,
                   checks_text=bool(params.stop or params.stop_regex))

    def may_stop(self, num_out: int, token: int) -> bool:
        """Whether `token`, output token number `num_out` (1-based), may stop the request: False
        means it does not; True means `reason` must decide (a stop string may not match)."""
        return num_out >= self.max_new_tokens or (
            num_out >= self.min_new_tokens and (self.checks_text or token in self.stop_ids))

    def reason(self, num_out: int, token: int, text: Callable[[], tuple[str, int]]
               ) -> tuple[dict[str, Any], int | None] | None:
        """The finish reason if `token`, output token number `num_out`, stops the request, and
        where its text is cut (after a matched stop string; None: not cut); None if it goes on.
        `text` gives the output text so far and how many of its first characters earlier checks
        searched (a `StopText`; called only when stop strings are checked)."""
        if num_out >= self.min_new_tokens:
            if token in self.stop_ids:
                return {"type": "stop", "matched": token}, None
            if self.checks_text:
                try:
                    found = self.match(*text())
                except PatternTimeout as e:
                    return {"type": "abort", "status_code": 400, "err_type": "BadRequest",
                            "message": f"stop_regex {str(e)!r} took more than "
                                       f"{PATTERN_BUDGET_S} s of matching; simplify it"}, None
                if found is not None:
                    matched, cut_at = found
                    return {"type": "stop", "matched": matched}, cut_at
        if num_out >= self.max_new_tokens:
            return {"type": "length", "length": num_out}, None
        return None

    def match(self, text: str, searched: int = 0) -> tuple[str, int] | None:
        """The stop string or pattern that occurs first in `text` (a string before a pattern at
        the same offset) and where the text is cut for it. Its first `searched` characters held
        no match of a string: one can start only where it reaches past them."""
        best: tuple[int, int, str] | None = None  # (start, length, what matched)
        for stop in self.strings:
            at = text.find(stop, max(searched - len(stop) + 1, 0))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, len(stop), stop)
        found = self.patterns.first(text) if self.patterns else None
        if found is not None and (best is None or found[0] < best[0]):
            best = found
        if best is None:
            return None
        at, length, matched = best
        return matched, at + length if self.keep_matched else at


class StopText:
    """The output text of a request with stop strings, for `StopRule.reason`: each call decodes
    only the tokens since the last whole characters and says how much of the text the previous
    call had final (searched then, without a match). A tokenizer that cleans up spaces
    (clean_up_tokenization_spaces) may change text across a seam: its whole output is decoded
    and searched at every call."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stream = (None if getattr(tokenizer, "clean_up_tokenization_spaces", False)
                       else StreamedText(tokenizer, skip_special_tokens))
        self.searched = 0

    def read(self, ids: list[int]) -> tuple[str, int]:
        """The decode of `ids` (the output so far, grown since the previous call) and how many
        of its first characters the previous call searched."""
        if self.stream is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip), 0
        searched = self.searched
        final = self.stream.update(ids)
        self.searched = len(final)
        return final + self.stream.pending, searched
