"""Prompt files for rollout and eval: loading, validation, chat templating and per-step selection.

A prompt file is JSONL or Parquet with one prompt per row:
`{"prompt": str | [{"role","content"}, ...], "label": str|null, "prompt_id": str, "metadata": {}}`.
Only `prompt` is required; `prompt_id` defaults to the row's position in the file, `label` to null.
A string prompt is the user turn; a list is a whole chat. The tokenizer's chat template is applied
once here (with the generation prompt), and from then on the conversation is carried as token ids.

Which prompts a step takes: `--step K` with `--rollout-batch-size P` takes the rows at positions
`[K*P, (K+1)*P)` of the file, cycling (position i is row `i mod num_rows`), so a loop resumes by
step alone. Over-sampling (dynamic filtering) continues from position `(K+1)*P` onwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltool.errors import BadInputError


@dataclass(frozen=True)
class Prompt:
    """One validated prompt row; `position` is its index in the cycled stream (the group id)."""

    prompt_id: str
    prompt: str | list[dict[str, str]]
    label: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    row_index: int = 0

    @property
    def messages(self) -> list[dict[str, str]]:
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return list(self.prompt)

    @property
    def text(self) -> str:
        """The prompt as one string (the user turn, or the chat's turns joined) for rewards/shards."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.prompt)


def load_prompts(path: str | os.PathLike) -> list[Prompt]:
    """Read and validate a .jsonl or .parquet prompt file; BadInputError names the row at fault."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"--prompts {path}: no such file; pass a .jsonl or .parquet prompt file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        raw = _read_jsonl(path)
    elif suffix == ".parquet":
        raw = _read_parquet(path)
    else:
        raise BadInputError(f"--prompts {path}: unknown file type {suffix!r}; use .jsonl or .parquet")
    if not raw:
        raise BadInputError(f"--prompts {path}: the file holds no prompts")
    prompts = [_validate_row(row, index=i, where=str(path)) for i, row in enumerate(raw)]
    seen: dict[str, int] = {}
    for p in prompts:
        if p.prompt_id in seen:
            raise BadInputError(f"--prompts {path}: rows {seen[p.prompt_id]} and {p.row_index} share "
                                f"prompt_id {p.prompt_id!r}; prompt ids must be unique")
        seen[p.prompt_id] = p.row_index
    return prompts


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise BadInputError(f"--prompts {path}: line {lineno} is not valid JSON ({e})") from e
    return rows


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise BadInputError(f"--prompts {path}: not a readable Parquet file ({e})") from e


def _validate_row(row: Any, *, index: int, where: str) -> Prompt:
    at = f"--prompts {where}: row {index}"
    if not isinstance(row, dict):
        raise BadInputError(f"{at} is a {type(row).__name__}, expected an object with a 'prompt'")
    if "prompt" not in row:
        raise BadInputError(f"{at} has no 'prompt' field (keys: {', '.join(sorted(row)) or 'none'})")
    prompt = row["prompt"]
    if isinstance(prompt, list):
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise BadInputError(f"{at}: a chat prompt must be a list of "
                                    "{'role': str, 'content': str} messages")
        if not prompt:
            raise BadInputError(f"{at}: the chat prompt is an empty list")
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    elif not isinstance(prompt, str) or not prompt:
        raise BadInputError(f"{at}: 'prompt' must be a non-empty string or a list of messages")
    label = row.get("label")
    if label is not None and not isinstance(label, str):
        label = json.dumps(label) if not isinstance(label, (int, float)) else str(label)
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as e:
            raise BadInputError(f"{at}: 'metadata' is a string but not JSON ({e})") from e
    if not isinstance(metadata, dict):
        raise BadInputError(f"{at}: 'metadata' must be an object")
    prompt_id = row.get("prompt_id")
    prompt_id = str(index) if prompt_id is None else str(prompt_id)
    return Prompt(prompt_id=prompt_id, prompt=prompt, label=label, metadata=metadata,
                  row_index=index)


def prompt_at(prompts: list[Prompt], position: int) -> Prompt:
    """The prompt at a stream position (the file cycles)."""
    return prompts[position % len(prompts)]


def render_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Chat-template the prompt (with the generation prompt) and return its token ids.

    Rendering to text and encoding without special tokens keeps the template's own special
    tokens exactly once (the template writes them as text).
    """
    text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise BadInputError(f"prompt {prompt.prompt_id!r} renders to no tokens")
    return list(ids)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A HF tokenizer from a directory; BadInputError when it cannot be loaded or has no template."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise BadInputError(f"--tokenizer {path}: cannot load a tokenizer ({e})") from e
    if not getattr(tok, "chat_template", None):
        raise BadInputError(f"--tokenizer {path}: the tokenizer has no chat template; rollout "
                            "applies the chat template to every prompt")
    return tok
