"""Offline character-level tokenizers for the built-in tasks, and the tokenizer hash.

The tokenizer is built with the `tokenizers` library (no hub access): every character is one
token, special tokens are matched whole first, and a Qwen-style chat template wraps turns in
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


def build_tokenizer(out_dir: str | os.PathLike, *, charset: str = CHARSET) -> None:
    """Write a HF fast tokenizer (tokenizer.json, tokenizer_config.json, chat template) to out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # "." does not match a newline in Oniguruma, so newlines are an explicit alternative.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
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
    """xxh3-64 hex over tokenizer.json bytes + the chat template (DESIGN.md shard metadata)."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{model_dir} has no tokenizer.json; point --tokenizer at a directory "
                              "with a fast tokenizer")
    h = xxhash.xxh3_64()
    h.update(path.read_bytes())
    h.update(read_chat_template(model_dir).encode())
    return h.hexdigest()
