"""Offline character-level tokenizers for the built-in tasks, and the tokenizer hash.

The tokenizer is built with the `tokenizers` library (no hub access): every character of a small
charset is one token (byte-level BPE without merges), special tokens are matched whole first, and a Qwen-style chat template wraps turns in
`<|im_start|>role\n...<|im_end|>\n`. `<|im_end|>` is EOS, `<|endoftext|>` is padding.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import xxhash

from rltool.errors import CheckpointError

PAD_TOKEN = "<|endoftext|>"
BOS_TURN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TURN, EOS_TOKEN, UNK_TOKEN]
CHARSET = string.digits + string.ascii_lowercase + " \n+-*/=()[],.:;?!<>_"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level(ch: str) -> str:
    """GPT-2/Qwen byte-to-unicode symbol of a one-byte character (" " -> "Ġ", "\n" -> "Ċ")."""
    b = ord(ch)
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def build_tokenizer(out_dir: str | os.PathLike, *, charset: str = CHARSET) -> None:
    """Write a HF fast tokenizer (tokenizer.json, tokenizer_config.json, chat template) to out_dir.

    The model is a byte-level BPE with no merges and only the charset's bytes in its vocabulary,
    i.e. Qwen2's tokenizer layout: transformers loads a `qwen2` checkpoint's tokenizer as
    `Qwen2Tokenizer`, which rebuilds the pipeline as byte-level BPE from the vocabulary, so any
    other layout would tokenize differently there (a WordLevel vocabulary lost spaces and
    newlines). Every loader (TokenizersBackend, Qwen2Tokenizer, SGLang) then gives the same ids.
    Characters outside the charset are dropped, as Qwen2Tokenizer does for unknown bytes.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab.setdefault(_byte_level(ch), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   unk_token=UNK_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def read_chat_template(model_dir: str | os.PathLike) -> str:
    """The chat template as saved by transformers (chat_template.jinja or tokenizer_config.json)."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    cfg = model_dir / "tokenizer_config.json"
    if cfg.exists():
        template = json.loads(cfg.read_text()).get("chat_template") or ""
        return template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return ""


def tokenizer_hash(model_dir: str | os.PathLike) -> str:
    """xxh3-64 hex over tokenizer.json bytes + the chat template (shard metadata, docs/formats.md)."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{model_dir} has no tokenizer.json; point --tokenizer at a directory "
                              "with a fast tokenizer")
    h = xxhash.xxh3_64()
    h.update(path.read_bytes())
    h.update(read_chat_template(model_dir).encode())
    return h.hexdigest()
