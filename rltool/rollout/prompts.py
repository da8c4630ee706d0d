"""Prompt files for rollout and eval: loading, validation, chat templating and per-step selection.

A prompt file is JSONL, Parquet, or a directory saved by HF `datasets` (`save_to_disk`: Arrow
files plus state.json, read with pyarrow alone), with one prompt per row. By default a row is
`{"prompt": str | [{"role","content"}, ...], "label": str|null, "prompt_id": str, "metadata": {}}`;
`PromptKeys` (slime's `--input-key`, `--label-key`, `--metadata-key`) names other fields, and a
dotted key reaches a nested one (`reward_model.ground_truth` in verl's prompt files). Only the
input is required; `prompt_id` defaults to the row's position in the file, the label to null.
A string prompt is the user turn; a list is a whole chat. With `apply_chat_template` (the default)
the tokenizer's chat template is applied once here (with the generation prompt); without it a
string prompt is encoded as it is. From then on the conversation is carried as token ids.

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

MISSING = object()


@dataclass(frozen=True)
class PromptKeys:
    """Which field of a row holds the prompt, the label and the metadata (dotted: nested)."""

    input: str = "prompt"
    label: str = "label"
    metadata: str = "metadata"


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


def load_prompts(path: str | os.PathLike, keys: PromptKeys = PromptKeys()) -> list[Prompt]:
    """Read and validate a prompt file or HF dataset directory; BadInputError names the row at
    fault."""
    path = Path(path)
    if path.is_dir():
        raw = read_hf_dataset_dir(path)
    elif not path.is_file():
        raise BadInputError(f"--prompts {path}: no such file; pass a .jsonl or .parquet prompt "
                            "file or a directory saved by HF datasets")
    elif path.suffix.lower() in (".jsonl", ".json"):
        raw = _read_jsonl(path)
    elif path.suffix.lower() == ".parquet":
        raw = _read_parquet(path)
    else:
        raise BadInputError(f"--prompts {path}: unknown file type {path.suffix.lower()!r}; use "
                            ".jsonl, .parquet or a directory saved by HF datasets")
    if not raw:
        raise BadInputError(f"--prompts {path}: the file holds no prompts")
    prompts = [_validate_row(row, index=i, where=str(path), keys=keys) for i, row in enumerate(raw)]
    seen: dict[str, int] = {}
    for p in prompts:
        if p.prompt_id in seen:
            raise BadInputError(f"--prompts {path}: rows {seen[p.prompt_id]} and {p.row_index} share "
                                f"prompt_id {p.prompt_id!r}; prompt ids must be unique")
        seen[p.prompt_id] = p.row_index
    return prompts


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadInputError(f"--prompts {path}: line {lineno} is not UTF-8 text ({e}); "
                                    "save the file as UTF-8") from e
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


def read_hf_dataset_dir(path: Path) -> list[Any]:
    """The rows of one split saved by `datasets.Dataset.save_to_disk`: the Arrow stream files
    that state.json lists, in order (pyarrow only; `datasets` need not be installed)."""
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise BadInputError(f"--prompts {path}: a DatasetDict with splits {', '.join(splits)}; "
                            f"pass one split's directory, e.g. {path / (splits or ['train'])[0]}")
    state_path = path / "state.json"
    try:
        state = json.loads(state_path.read_text())
        files = [path / entry["filename"] for entry in state["_data_files"]]
    except FileNotFoundError as e:
        raise BadInputError(f"--prompts {path}: a directory without state.json; pass a prompt "
                            "file or a directory written by datasets' save_to_disk") from e
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BadInputError(f"--prompts {state_path}: not a datasets state.json ({e!r})") from e
    rows: list[Any] = []
    for file in files:
        try:
            with pa.memory_map(str(file)) as source:
                rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
        except (pa.ArrowInvalid, OSError) as e:
            raise BadInputError(f"--prompts {file}: not a readable Arrow file of a saved "
                                f"dataset ({e})") from e
    return rows


def field_at(row: dict[str, Any], key: str) -> Any:
    """`row[key]`, or for a dotted key the nested field (`a.b` -> row["a"]["b"]); MISSING when
    absent. A top-level key that itself contains dots wins over the nested path."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _validate_row(row: Any, *, index: int, where: str, keys: PromptKeys) -> Prompt:
    at = f"--prompts {where}: row {index}"
    if not isinstance(row, dict):
        raise BadInputError(f"{at} is a {type(row).__name__}, expected an object with a "
                            f"{keys.input!r}")
    prompt = field_at(row, keys.input)
    if prompt is MISSING:
        raise BadInputError(f"{at} has no {keys.input!r} field (keys: "
                            f"{', '.join(sorted(row)) or 'none'}); name the prompt's field with "
                            "--input-key")
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
        raise BadInputError(f"{at}: {keys.input!r} must be a non-empty string or a list of "
                            "messages")
    label = field_at(row, keys.label)
    if label is MISSING:
        label = None
    if label is not None and not isinstance(label, str):
        label = json.dumps(label) if not isinstance(label, (int, float)) else str(label)
    metadata = field_at(row, keys.metadata)
    metadata = {} if metadata is MISSING or metadata is None else metadata
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata) if metadata else {}
        except json.JSONDecodeError as e:
            raise BadInputError(f"{at}: {keys.metadata!r} is a string but not JSON ({e})") from e
    if not isinstance(metadata, dict):
        raise BadInputError(f"{at}: {keys.metadata!r} must be an object")
    prompt_id = row.get("prompt_id")
    prompt_id = str(index) if prompt_id is None else str(prompt_id)
    return Prompt(prompt_id=prompt_id, prompt=prompt, label=label, metadata=metadata,
                  row_index=index)


def prompt_at(prompts: list[Prompt], position: int) -> Prompt:
    """The prompt at a stream position (the file cycles)."""
    return prompts[position % len(prompts)]


def render_prompt(tokenizer: Any, prompt: Prompt, *, apply_chat_template: bool = True) -> list[int]:
    """The prompt's token ids: chat-templated with the generation prompt, or (without the
    template) the string prompt encoded as it is.

    Rendering to text and encoding without special tokens keeps the template's own special
    tokens exactly once (the template writes them as text).
    """
    if apply_chat_template:
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False,
                                             add_generation_prompt=True)
    elif isinstance(prompt.prompt, str):
        text = prompt.prompt
    else:
        raise BadInputError(f"prompt {prompt.prompt_id!r} is a chat (a list of messages), which "
                            "needs --apply-chat-template")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise BadInputError(f"prompt {prompt.prompt_id!r} renders to no tokens")
    return list(ids)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A HF tokenizer from a directory; BadInputError when it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # transformers' messages span several lines
        raise BadInputError(f"--tokenizer {path}: cannot load a tokenizer ({reason}); pass the "
                            "model's directory (with tokenizer.json)") from e


def check_chat_template(tokenizer: Any, *, where: str) -> None:
    """BadInputError when the tokenizer has no chat template to apply."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadInputError(f"--tokenizer {where}: the tokenizer has no chat template; pass "
                            "--no-apply-chat-template to encode string prompts as they are")


_TOKENIZER_CACHE: dict[tuple[Any, ...], tuple[Any, str]] = {}
_PROMPTS_CACHE: dict[tuple[Any, ...],
                     tuple[list[Prompt], dict[tuple[str, bool], dict[int, list[int]]]]] = {}


def cached_prompts(path: str | Path, keys: PromptKeys
                   ) -> tuple[list[Prompt], dict[tuple[str, bool], dict[int, list[int]]]]:
    """(prompts of a file, their rendered token ids by (tokenizer hash, chat template) and row),
    kept while the file is unchanged (size, mtime): the loop's rollout takes a step's prompts from
    the same file every step, and reading and rendering it again was a fixed cost of every step.
    A dataset directory is read every time (its own mtime does not follow its files)."""
    root = Path(path).resolve()
    if not root.is_file():
        return load_prompts(path, keys), {}  # load_prompts reads a directory or names the error
    stat = root.stat()
    key = (str(root), stat.st_size, stat.st_mtime_ns, keys)
    if key not in _PROMPTS_CACHE:
        if len(_PROMPTS_CACHE) >= 2:  # the loop's rollout and eval files
            _PROMPTS_CACHE.pop(next(iter(_PROMPTS_CACHE)))
        _PROMPTS_CACHE[key] = (load_prompts(root, keys), {})
    return _PROMPTS_CACHE[key]


def cached_tokenizer(path: str | Path) -> tuple[Any, str]:
    """(tokenizer, tokenizer hash) of a directory, kept while its files are unchanged (name, size,
    mtime): a loop calls the stage every step with the same tokenizer, and loading it again cost
    more than the batched generation of a demo step's requests."""
    from rltool.data.tokenizer import tokenizer_hash

    root = Path(path).resolve()
    try:
        key = (str(root), *sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                  for p in root.iterdir() if p.is_file()))
    except OSError:
        key = None
    if key is not None and key in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[key]
    value = (load_tokenizer(root), tokenizer_hash(root))
    if key is not None:
        _TOKENIZER_CACHE.clear()  # one entry: the loop's tokenizer
        _TOKENIZER_CACHE[key] = value
    return value
