"""Incremental detokenization: the text of a growing output, decoding only the tokens since the
last whole characters (as SGLang's detokenizer does). A streamed request's text is this in
either layout (decoded by the scheduler thread in one process, by the HTTP front end in two); the
stop check searches it (rltool/engine/stop_rule.py).
"""

from __future__ import annotations

import re
from typing import Any

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece byte-fallback token


def joins_byte_runs(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder has SentencePiece byte fallback (Llama, Mistral): it
    decodes a run of byte tokens (<0xNN>) together and turns every byte of a run that is not
    valid UTF-8 into U+FFFD, so the next byte token can change the text of the run before it."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()


class StreamedText:
    """The text of a request's output so far, decoding only the tokens since the last whole
    characters: the tokens from `prefix` to `read` were decoded last time; decoding from `prefix`
    again with the new ones and keeping what lies past that earlier decode gets a tokenizer's
    leading-space rules right at the seam. Text ending in U+FFFD (a character whose bytes are not
    all out yet) waits for the next tokens in `pending`, and so does text ending in a byte token
    of a byte-fallback tokenizer (`joins_byte_runs`): `text` is final, `text + pending` is the
    decode of the whole output. The final text of a request is the scheduler's (a decode of the
    whole output)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self.pending = ""
        self.prefix = 0
        self.read = 0
        self.byte_runs = joins_byte_runs(tokenizer)
        # skipped special tokens do not end a run of byte tokens
        self.skipped = frozenset(tokenizer.all_special_ids if self.byte_runs and self.skip else ())

    def update(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        before = decode(ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = decode(ids[self.prefix:], skip_special_tokens=self.skip)
        if (len(after) > len(before) and not after.endswith("\ufffd")
                and not (self.byte_runs and self.ends_in_byte_token(ids))):
            self.text += after[len(before):]
            self.pending = ""
            self.prefix, self.read = self.read, len(ids)
        else:
            self.pending = after[len(before):]
        return self.text

    def ends_in_byte_token(self, ids: list[int]) -> bool:
        for token in reversed(ids):
            if token not in self.skipped:
                piece = self.tokenizer.convert_ids_to_tokens(token) or ""
                return BYTE_TOKEN.fullmatch(piece) is not None
        return False
