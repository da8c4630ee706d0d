"""Stop strings checked on new text only (`StopText`): at every step the incremental check gives
the decision of a search of the whole decoded output (same finish reason, matched string and cut
position) and its text is the whole decode, for a byte-level (Qwen) and a byte-fallback (Llama)
tokenizer, and it decodes only the tokens since the last whole characters."""

from __future__ import annotations

import random
import re

import pytest

from rltool.data.tokenizer import CHARSET, build_tokenizer
from rltool.engine.loading import load_tokenizer
from rltool.engine.sampling import SamplingParams
from rltool.engine.stop_rule import StopRule, StopText

# One token per byte: every character outside ASCII spans two to four tokens, and random ids
# give invalid and cut-off UTF-8 (decoded as U+FFFD).
HIGH_BYTES = "".join(chr(b) for b in range(0x80, 0x100))
WORDS = ["a", "ab", "é", "中", "中文", "😀", " ", "\n", "end", "x=1", "ß", "ünï", ".", "?!"]
SPECIAL_IDS = [0, 1, 2]  # special tokens of both tokenizers


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("byte-tokenizer")
    build_tokenizer(out, charset=CHARSET + HIGH_BYTES)
    return load_tokenizer(out)


def byte_fallback_tokenizer():
    """A Llama-style SentencePiece BPE: "▁" pieces, a leading space stripped, characters outside
    its vocabulary as byte tokens (<0xNN>) that decode a run together (all U+FFFD when the run
    is not valid UTF-8), special tokens that skip_special_tokens drops from within a run."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "▁a", "▁ab", "ab", "é", "▁é", "x", "=", "1", "▁x", "中", "end"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "a"), ("▁a", "b"), ("a", "b"), ("▁", "x"), ("▁", "é")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


class Counting:
    """A tokenizer that records how many tokens each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces
        self.calls: list[int] = []

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


def random_output(rng: random.Random, tokenizer) -> list[int]:
    """Token ids of random text with multibyte characters, some random ids (cut characters,
    stray continuation bytes) and special tokens in between."""
    ids: list[int] = []
    for _ in range(rng.randint(5, 40)):
        roll = rng.random()
        if roll < 0.75:
            ids += tokenizer.encode(rng.choice(WORDS), add_special_tokens=False)
        elif roll < 0.9:
            ids.append(rng.randrange(len(SPECIAL_IDS), tokenizer.vocab_size))
        else:
            ids.append(rng.choice(SPECIAL_IDS))
    return ids


def random_stops(rng: random.Random, text: str) -> tuple[list[str], list[str]]:
    """Stop strings drawn from substrings of the output's text (and some absent ones), and
    regular expressions, some of which look past their match or far back into the text."""
    def piece() -> str:
        if not text or rng.random() < 0.2:
            return rng.choice(["zz", "中文😀", "\ufffd", "q?"])
        start = rng.randrange(len(text))
        return text[start:start + rng.randint(1, 6)]

    strings = [piece() for _ in range(rng.randint(0, 3))]
    pool = [re.escape(piece()), "a.*b", r"é(?=\s)", "end$", r"\bab\b", "中+", r"(?<=x)=\d",
            r"\ufffd{2}"]
    patterns = rng.sample(pool, rng.randint(0, 2)) if rng.random() < 0.5 else []
    if not strings and not patterns:
        strings = [piece()]
    return strings, patterns


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
@pytest.mark.parametrize("seed", range(3))
def test_incremental_check_decides_as_a_whole_text_search_at_every_step(tokenizer, kind, seed):
    if kind == "byte-fallback":
        tokenizer = byte_fallback_tokenizer()
    rng = random.Random(seed)
    for _ in range(60):
        ids = random_output(rng, tokenizer)
        skip = rng.random() < 0.5
        strings, patterns = random_stops(rng, tokenizer.decode(ids, skip_special_tokens=skip))
        params = SamplingParams(max_new_tokens=len(ids), stop=strings, stop_regex=patterns,
                                no_stop_trim=rng.random() < 0.5, skip_special_tokens=skip,
                                min_new_tokens=rng.choice([0, 0, 3, 10]))
        rule = StopRule.for_request(params, prompt_len=1, eos_token_ids=[], context_length=10_000)
        text = StopText(tokenizer, skip)
        for n in range(1, len(ids) + 1):
            whole = tokenizer.decode(ids[:n], skip_special_tokens=skip)
            read: list[str] = []

            def incremental() -> tuple[str, int]:
                got = text.read(ids[:n])
                read.append(got[0])
                return got

            expected = rule.reason(n, ids[n - 1], lambda: (whole, 0))
            assert rule.reason(n, ids[n - 1], incremental) == expected, (ids[:n], strings,
                                                                          patterns)
            assert read == ([whole] if n >= rule.min_new_tokens else [])
            if expected is not None:
                break


def test_only_the_tokens_since_the_last_whole_characters_are_decoded(tokenizer):
    """Each check of a 2,000-token output decodes the new token and the seam's (at most 8
    tokens per call: a 4-byte character cut before its last byte and the new token), not the
    whole output, and still finds the stop string at its end."""
    rng = random.Random(0)
    ids: list[int] = []
    while len(ids) < 2000:
        ids += tokenizer.encode(rng.choice(WORDS), add_special_tokens=False)
    ids += tokenizer.encode("stop!", add_special_tokens=False)
    rule = StopRule.for_request(SamplingParams(max_new_tokens=len(ids), stop=["stop!"]),
                                prompt_len=1, eos_token_ids=[], context_length=10_000)
    counting = Counting(tokenizer)
    text = StopText(counting, True)
    for n in range(1, len(ids) + 1):
        counting.calls.clear()
        stop = rule.reason(n, ids[n - 1], lambda: text.read(ids[:n]))
        assert counting.calls and max(counting.calls) <= 8, (n, counting.calls)
        if stop is not None:
            break
    cut_at = len(tokenizer.decode(ids)) - len("stop!")
    assert n == len(ids) and stop == ({"type": "stop", "matched": "stop!"}, cut_at)


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_and_searched_whole(tokenizer):
    """clean_up_tokenization_spaces can change text already out (" ." becomes "."): such a
    tokenizer's whole output is decoded at every check, and nothing counts as searched."""
    counting = Counting(tokenizer)
    counting.clean_up_tokenization_spaces = True
    text = StopText(counting, True)
    ids = tokenizer.encode("ab cd .", add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        counting.calls.clear()
        assert text.read(ids[:n]) == (tokenizer.decode(ids[:n], skip_special_tokens=True), 0)
        assert counting.calls == [n]
