"""The model side of the builtin engine: forward passes over a KV cache, weight loading, memory.

KV layout. A request being prefilled owns a batch-of-one `DynamicCache`. Once its prompt is in the
cache it joins the running `DecodeBatch`: one batched `DynamicCache` of shape [B, H, L, D] per layer,
left-padded, with a [B, L] attention mask and each row's next position id. A decode step is one
forward of [B, 1] tokens. A finished row becomes a free slot (`free`): it keeps decoding junk for a
few steps, and a row that joins meanwhile is written into it right-aligned (its unused columns masked
out), so a busy batch does not copy its whole cache each time one request ends and another begins.
Slots free for longer are dropped (`drop_idle`: select rows, trim columns that are padding for every
remaining row); joining with no free slot pads the shorter side on the left and concatenates.

Every method runs on the scheduler thread; nothing here is thread-safe on its own.
"""

from __future__ import annotations

import gc
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rltool.engine.loading import check_servable, load_model, load_tokenizer
from rltool.errors import BadInputError, CheckpointError
from rltool.faults import kill_point

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def _cache_kwarg(model: Any) -> str:
    """The forward keyword of the KV cache: `cache` from transformers 5.2x on, `past_key_values`
    before. An unknown keyword is swallowed by **kwargs, so passing the wrong one silently runs
    every step without the cache (seen with transformers 5.17 on the GPU host)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _layers(cache: Any) -> list[Any]:
    return list(cache.layers)


def _pad_left(t: torch.Tensor, n: int, *, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class DecodeBatch:
    """The running batch's shared KV cache. Row i belongs to `rids[i]`; None marks a free row."""

    rids: list[str | None] = field(default_factory=list)
    idle: list[int] = field(default_factory=list)  # decode steps each free row has been free
    cache: Any = None
    mask: torch.Tensor | None = None  # [B, L] int64, 1 = real token
    next_pos: torch.Tensor | None = None  # [B] int64, position id of the token fed next

    def __len__(self) -> int:
        return len(self.rids)

    @property
    def live(self) -> list[str]:
        return [r for r in self.rids if r is not None]


class ModelRunner:
    """A transformers causal LM plus the checkpoint it came from."""

    def __init__(self, model_path: str | Path, *, dtype: str = "fp32",
                 weight_version: str = "default"):
        if dtype not in DTYPES:
            raise BadInputError(f"unknown --dtype {dtype!r}; choose fp32 or bf16")
        self.model_path = Path(model_path)
        self.tokenizer_path = self.model_path
        self.dtype = dtype
        self.weight_version = weight_version
        check_servable(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model: Any = None
        self._load_model(self.model_path)
        config = self.model.config
        self.config = config
        self.context_length = int(getattr(config, "max_position_embeddings", 2048))
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = self._eos_ids()

    # ----- weights -------------------------------------------------------------------------

    def _load_model(self, path: Path) -> None:
        self.model = load_model(path, dtype=DTYPES[self.dtype])
        self.model.eval()
        self.model.requires_grad_(False)
        self._cache_kwarg = _cache_kwarg(self.model)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model.generation_config, "eos_token_id", None),
                       self.config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(x) for x in source)
        return ids

    @property
    def released(self) -> bool:
        return self.model is None

    def release(self) -> None:
        """Drop the model (parameters and buffers); `resume` reloads from `model_path`."""
        self.model = None
        gc.collect()

    def resume(self) -> None:
        if self.model is None:
            self._load_model(self.model_path)

    def load_weights(self, path: str | Path) -> int:
        """Copy a HF checkpoint's tensors into the live model after checking every name and shape.

        Nothing changes unless the whole checkpoint matches. Returns the number of tensors loaded.
        """
        from rltool.io.checkpoint import open_checkpoint
        from rltool.io.reader import read_tensor

        path = Path(path)
        if self.model is None:
            raise BadInputError("weights are released; call /resume_memory_occupation first")
        ckpt = open_checkpoint(path)  # index-aware, every file name and header checked
        params = dict(self.model.named_parameters(remove_duplicate=False))
        loaded: dict[str, torch.Tensor] = {}
        for name, info in ckpt.tensors().items():
            if name not in params:
                raise CheckpointError(f"{info.path.name}: tensor {name!r} is not a parameter of "
                                      "the served model")
            if info.shape != tuple(params[name].shape):
                raise CheckpointError(
                    f"{info.path.name}: tensor {name!r} has shape {list(info.shape)}, the served "
                    f"model expects {list(params[name].shape)}")
            loaded[name] = read_tensor(info)  # mapped read-only; copied into the parameter below
        # Tied parameters (e.g. lm_head = embed_tokens) appear under several names; one suffices.
        by_storage: dict[int, list[str]] = {}
        for name, p in params.items():
            by_storage.setdefault(id(p), []).append(name)
        missing = [names[0] for names in by_storage.values()
                   if not any(n in loaded for n in names)]
        if missing:
            raise CheckpointError(f"{path} lacks {len(missing)} tensors of the served model, "
                                  f"e.g. {missing[0]!r}")
        with torch.no_grad():
            for name, t in loaded.items():
                kill_point("engine.copy_param")
                params[name].copy_(t.to(params[name].dtype))
        self.model_path = path
        return len(loaded)

    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors (any subset of the parameters, e.g. one bucket) into the live model,
        after checking every name, shape and dtype: nothing changes unless all of them match.
        The tensors may be views of a sender's buffer; they are copied, never kept. Memory release
        reloads `model_path`, so a model updated this way should not be released (the loop
        re-sends its weights after a resume)."""
        if self.model is None:
            raise BadInputError("weights are released; call /resume_memory_occupation first")
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, t in named:
            p = params.get(name)
            if p is None:
                raise BadInputError(f"tensor {name!r} is not a parameter of the served model")
            if tuple(t.shape) != tuple(p.shape):
                raise BadInputError(f"tensor {name!r} has shape {list(t.shape)}, the served model "
                                    f"expects {list(p.shape)}")
            if t.dtype != p.dtype:
                raise BadInputError(f"tensor {name!r} has dtype {t.dtype}, the served model "
                                    f"holds {p.dtype}; send it as {p.dtype}")
        with torch.no_grad():
            for name, t in named:
                params[name].copy_(t)
        return len(named)

    # ----- forwards ------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, token_ids: list[int], cache: Any | None) -> tuple[torch.Tensor, Any]:
        """Extend a batch-of-one cache with `token_ids`; returns (logits of the last token, cache)."""
        cache = cache if cache is not None else _new_cache()
        start = cache.get_seq_length()
        ids = torch.tensor([token_ids], dtype=torch.long)
        pos = torch.arange(start, start + len(token_ids)).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kwarg: cache})
        return out.logits[0, -1].float(), cache

    @torch.no_grad()
    def decode_one(self, token_id: int, cache: Any) -> torch.Tensor:
        """One decode step for a single request on its own cache (deterministic mode)."""
        logits, _ = self.prefill([token_id], cache)
        return logits

    @torch.no_grad()
    def decode(self, batch: DecodeBatch, token_ids: list[int]) -> torch.Tensor:
        """One batched decode step: token_ids[i] is fed to row i. Returns logits [B, V] float32."""
        ids = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)
        mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], dim=1)
        # Without padding the mask changes nothing for a single query token; leaving it out
        # skips building a 4-D mask every step (~15% of a tiny model's decode step).
        out = self.model(input_ids=ids, attention_mask=None if bool(mask.all()) else mask,
                         position_ids=batch.next_pos.unsqueeze(1), use_cache=True,
                         **{self._cache_kwarg: batch.cache})
        batch.mask = mask
        batch.next_pos = batch.next_pos + 1
        batch.idle = [n + (rid is None) for rid, n in zip(batch.rids, batch.idle)]
        return out.logits[:, -1].float()

    @torch.no_grad()
    def prefill_batch(self, rids: list[str], seqs: list[list[int]]) -> tuple[torch.Tensor,
                                                                             DecodeBatch]:
        """Prefill several fresh sequences in one left-padded forward.

        Returns (logits of each row's last token [k, V] float32, the rows as a DecodeBatch).
        Padding columns hold junk KV that the attention mask hides from every later step.
        """
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs],
                            dtype=torch.long)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = _new_cache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kwarg: cache})
        block = DecodeBatch(rids=list(rids), idle=[0] * len(rids), cache=cache, mask=mask,
                            next_pos=torch.tensor([len(s) for s in seqs]))
        return out.logits[:, -1].float(), block

    @staticmethod
    def single(rid: str, cache: Any) -> DecodeBatch:
        """A prefilled batch-of-one cache as a one-row DecodeBatch."""
        length = cache.get_seq_length()
        return DecodeBatch(rids=[rid], idle=[0], cache=cache,
                           mask=torch.ones(1, length, dtype=torch.long),
                           next_pos=torch.tensor([length]))

    @staticmethod
    def join(batch: DecodeBatch, block: DecodeBatch) -> None:
        """Add `block`'s rows to `batch`: into free rows first (written right-aligned, the columns
        before them masked), the rest appended (left-padding whichever side is narrower)."""
        if not batch.live:
            batch.rids, batch.idle, batch.cache = list(block.rids), list(block.idle), block.cache
            batch.mask, batch.next_pos = block.mask, block.next_pos
            return
        width, other = batch.mask.shape[1], block.mask.shape[1]
        total = max(width, other)
        if total > width:
            for layer in _layers(batch.cache):
                layer.keys = _pad_left(layer.keys, total - width, dim=2)
                layer.values = _pad_left(layer.values, total - width, dim=2)
            batch.mask = _pad_left(batch.mask, total - width, dim=1)
        free = [i for i, rid in enumerate(batch.rids) if rid is None][:len(block)]
        if free:
            slots, rows = torch.tensor(free), torch.arange(len(free))
            for mine, theirs in zip(_layers(batch.cache), _layers(block.cache)):
                mine.keys[slots, :, total - other:] = theirs.keys[rows]
                mine.values[slots, :, total - other:] = theirs.values[rows]
            batch.mask[slots] = 0
            batch.mask[slots, total - other:] = block.mask[rows]
            batch.next_pos[slots] = block.next_pos[rows]
            for slot, rid in zip(free, block.rids):
                batch.rids[slot], batch.idle[slot] = rid, 0
        if len(free) == len(block):
            return
        rest = slice(len(free), None)
        for mine, theirs in zip(_layers(batch.cache), _layers(block.cache)):
            mine.keys = torch.cat([mine.keys, _pad_left(theirs.keys[rest], total - other, dim=2)])
            mine.values = torch.cat([mine.values,
                                     _pad_left(theirs.values[rest], total - other, dim=2)])
        batch.mask = torch.cat([batch.mask, _pad_left(block.mask[rest], total - other, dim=1)])
        batch.next_pos = torch.cat([batch.next_pos, block.next_pos[rest]])
        batch.rids.extend(block.rids[rest])
        batch.idle.extend(block.idle[rest])

    @staticmethod
    def free(batch: DecodeBatch, live: Collection[str]) -> None:
        """Turn the rows of requests no longer in `live` into free rows (no copy)."""
        for i, rid in enumerate(batch.rids):
            if rid is not None and rid not in live:
                batch.rids[i], batch.idle[i] = None, 0

    @staticmethod
    def drop_idle(batch: DecodeBatch, *, max_idle_steps: int) -> None:
        """Drop rows free for at least `max_idle_steps` decode steps (0: every free row)."""
        rows = [i for i, (rid, n) in enumerate(zip(batch.rids, batch.idle))
                if rid is not None or n < max_idle_steps]
        if len(rows) != len(batch):
            ModelRunner._select(batch, rows)

    @staticmethod
    def keep(batch: DecodeBatch, rids: list[str]) -> None:
        """Keep only the requests `rids` (in their current order), no free rows, and drop columns
        that are padding for every row kept."""
        if rids != batch.rids:
            ModelRunner._select(batch, [batch.rids.index(r) for r in rids])

    @staticmethod
    def _select(batch: DecodeBatch, rows: list[int]) -> None:
        if not any(batch.rids[i] is not None for i in rows):
            batch.rids, batch.idle, batch.cache, batch.mask, batch.next_pos = [], [], None, None, None
            return
        index = torch.tensor(rows)
        mask = batch.mask[index]
        first = int((mask.sum(dim=0) > 0).nonzero()[0])
        for layer in _layers(batch.cache):
            layer.keys = layer.keys[index, :, first:].contiguous()
            layer.values = layer.values[index, :, first:].contiguous()
        batch.mask = mask[:, first:].contiguous()
        batch.next_pos = batch.next_pos[index]
        batch.idle = [batch.idle[i] for i in rows]
        batch.rids = [batch.rids[i] for i in rows]

    @torch.no_grad()
    def full_pass_logits(self, token_ids: list[int], *, start: int) -> torch.Tensor:
        """Logits [T - start, V] predicting token_ids[start:], from one unpadded pass over the whole
        sequence: exactly `rltool.logprobs.sequence_logprobs`'s layout (the trainer's)."""
        ids = torch.tensor([token_ids], dtype=torch.long)
        return self.model(input_ids=ids, use_cache=False).logits[0][start - 1:-1]

    # ----- info ----------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        info = model_info(self, model_type=getattr(self.config, "model_type", None),
                          architectures=list(getattr(self.config, "architectures", None) or []))
        return {**info, "device": "cpu", "dtype": self.dtype}


def model_info(runner: Any, *, model_type: str | None, architectures: list[str]) -> dict[str, Any]:
    """SGLang's /get_model_info body for a runner (model_path, tokenizer_path, weight_version)."""
    return {
        "model_path": str(runner.model_path),
        "tokenizer_path": str(runner.tokenizer_path),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": runner.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model_type,
        "architectures": architectures,
    }
