"""Incremental detokenization: the text of a growing output, decoding only the tokens since the
last whole characters (as SGLang's detokenizer does). The HTTP front end streams it; the stop
check searches it (rltool/engine/stop_text.py).
"""

from __future__ import annotations

from typing import Any


class StreamedText:
    """The text of a request's output so far, decoding only the tokens since the last whole
    characters: the tokens from `prefix` to `read` were decoded last time; decoding from `prefix`
    again with the new ones and keeping what lies past that earlier decode gets a tokenizer's
    leading-space rules right at the seam. Text ending in U+FFFD (a character whose bytes are not
    all out yet) waits for the next tokens in `pending`: `text` is final, `text + pending` is the
    decode of the whole output. The final text of a request is the scheduler's (a decode of the
    whole output)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self.pending = ""
        self.prefix = 0
        self.read = 0

    def update(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        before = decode(ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = decode(ids[self.prefix:], skip_special_tokens=self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.pending = ""
            self.prefix, self.read = self.read, len(ids)
        else:
            self.pending = after[len(before):]
        return self.text
