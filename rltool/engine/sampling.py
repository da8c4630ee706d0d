"""Per-request sampling parameters and the pieces every sampler shares (bias, filters, logprobs).

Logprob convention (rltool.logprobs): the reported logprob of a token is taken from the
temperature-scaled distribution *before* top-k / top-p / min-p filtering; greedy requests report
logprobs at temperature 1.0. Filtering only changes which token is drawn.

Sampling draws with the exponential race (argmax of p / E, E ~ Exp(1)), which is exactly a draw
from p and needs one noise vector per row, so a request's draw depends on its own noise only:
on the Triton sampler a counter-based hash of its seed and token index, on the CPU torch sampler
its own `torch.Generator` (deterministic mode). The engine samples with
`batch_sampling.sample_batch`; the per-row references they are tested against are
`tests/helpers/sampling.py` (torch) and `tests/helpers/fused_sampling.py` (the kernel's draw).
"""

from __future__ import annotations

from typing import Any

import regex
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rltool.logprobs import GREEDY_TEMPERATURE

MAX_STOP_STRINGS = 32
MAX_ID = 2**31 - 1  # token ids and top_k travel as int32 on the device
DEFAULT_SEED = 42  # SGLang's fallback seed in deterministic inference


class SamplingParams(BaseModel):
    """SGLang's `sampling_params` (unknown keys are rejected, `null` means the default; every
    float finite, every id a non-negative int32, every stop_regex compiled here)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=0, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, description="Below 1e-6 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass, in (0, 1].")
    top_k: int = Field(-1, description="-1 (whole vocabulary) or >= 1.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (at most 32).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Checked besides EOS.")
    stop_regex: list[str] = Field(default_factory=list, description="Stop regexes (at most 32).")
    ignore_eos: bool = Field(False, description="Do not stop on EOS.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from `text`.")
    no_stop_trim: bool = Field(False, description="Keep the matched stop string in `text`.")
    n: int = Field(1, ge=1, description="Parallel samples per prompt.")
    sampling_seed: int | None = Field(None, description="Seed (deterministic mode only).")
    min_new_tokens: int = Field(0, ge=0, le=MAX_ID,
                                description="EOS / stop tokens are masked before this.")
    logit_bias: dict[str, float] | None = Field(None, description="token id (str) -> added logit.")
    # Accepted for SGLang compatibility; only their neutral values are supported (checked below).
    frequency_penalty: float = Field(0.0, description="Unsupported unless 0.")
    presence_penalty: float = Field(0.0, description="Unsupported unless 0.")
    repetition_penalty: float = Field(1.0, description="Unsupported unless 1.")
    json_schema: str | None = Field(None, description="Unsupported (constrained decoding).")
    regex: str | None = Field(None, description="Unsupported (constrained decoding).")
    ebnf: str | None = Field(None, description="Unsupported (constrained decoding).")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("stop", "stop_regex", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop", "stop_regex")
    @classmethod
    def _at_most_32(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("stop_regex")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                regex.compile(pattern)
            except regex.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a regular expression ({e})"
                                 ) from None
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value != -1 and not 1 <= value <= MAX_ID:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or in [1, {MAX_ID}]")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int]) -> list[int]:
        bad = next((t for t in value if not 0 <= t <= MAX_ID), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids holds {bad}, not a token id in [0, {MAX_ID}]")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((k for k in value or {} if not (k.isdecimal() and int(k) <= MAX_ID)), None)
        if bad is not None:
            raise ValueError(f"logit_bias key {bad!r} is not a token id; keys are token ids "
                             f"written in decimal, in [0, {MAX_ID}]")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> "SamplingParams":
        if self.frequency_penalty != 0.0 or self.presence_penalty != 0.0:
            raise ValueError("frequency_penalty / presence_penalty are not supported by the "
                             "builtin engine; leave them at 0")
        if self.repetition_penalty != 1.0:
            raise ValueError("repetition_penalty is not supported by the builtin engine; use 1.0")
        if self.json_schema or self.regex or self.ebnf:
            raise ValueError("constrained decoding (json_schema/regex/ebnf) is not supported by "
                             "the builtin engine")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_filter(self) -> bool:
        return not self.greedy and (self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0)


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def bias_logits(logits: torch.Tensor, params: list[SamplingParams], *,
                suppressed: list[list[int]]) -> torch.Tensor:
    """Apply logit_bias and mask `suppressed[i]` (EOS/stop ids before min_new_tokens) per row.

    Only changes what is drawn; logprobs are computed from the unbiased logits.
    """
    if not any(p.logit_bias for p in params) and not any(suppressed):
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    for row, (p, sup) in enumerate(zip(params, suppressed)):
        for tok, bias in (p.logit_bias or {}).items():
            if 0 <= int(tok) < vocab:
                out[row, int(tok)] += bias
        if sup:
            out[row, [t for t in sup if 0 <= t < vocab]] = float("-inf")
    return out


def filter_probs(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the tokens top-k / top-p / min-p remove (rows without filters are untouched)."""
    vocab = probs.shape[-1]
    dev = probs.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).to(dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).to(dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).to(dev)
    return probs.masked_fill(filter_mask(probs, top_k=top_k, top_p=top_p, min_p=min_p), 0.0)


def filter_mask(probs: torch.Tensor, *, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """[B, V] bool: the tokens top-k / top-p / min-p remove from each row of `probs`, given per
    row (top_k [B] int, the vocabulary size when off; top_p, min_p [B] of probs' dtype). By
    descending probability, ties by id, a token goes when its rank is past top_k, the mass
    before it is past top_p, or it is below min_p times the top; the top always stays.

    What is kept is a prefix of that order, so it is fixed by its length n and its last value v:
    every token above v, then the lowest ids among those equal to v. Only the sorted values are
    needed, and with `max_k` (every row's top_k is at most it) only the largest max_k of them
    (a top-k instead of a sort of the vocabulary). A fixed number of batched launches whatever B
    (CUDA-graph capturable)."""
    if max_k is not None and max_k < probs.shape[-1]:
        sorted_p = probs.topk(max_k, dim=-1).values
    else:
        sorted_p = probs.sort(dim=-1, descending=True).values
    ranks = torch.arange(sorted_p.shape[-1], device=probs.device).unsqueeze(0)
    exclusive_mass = sorted_p.cumsum(dim=-1) - sorted_p
    remove = ((ranks >= top_k.unsqueeze(1)) | (exclusive_mass > top_p.unsqueeze(1))
              | (sorted_p < min_p.unsqueeze(1) * sorted_p[:, :1]))
    remove[:, 0] = False  # the most likely token always survives
    kept = (~remove).sum(dim=-1, keepdim=True)
    last = sorted_p.gather(1, kept - 1)
    above = probs > last
    tied = probs == last
    need = kept - above.sum(dim=-1, keepdim=True)
    return ~(above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= need)))
