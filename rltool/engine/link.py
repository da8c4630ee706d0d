"""What the HTTP front end knows of the engine it serves, and how it reaches it.

`EngineInfo`: the facts fixed at start that validation and responses need (tokenizer, limits).
`LocalLink`: the scheduler thread of this process (one-process layout). Its twin for the
two-process layout is rltool.engine.remote_link.RemoteLink; both offer `submit`, `abort`,
`call` (a named operation of rltool.engine.ops.EngineOps), `alive`, `weight_version`,
`lora_names` and `request_stop`, so the routes serve either layout unchanged.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rltool.engine.ops import EngineOps
from rltool.engine.request import Request


@dataclass(frozen=True)
class EngineInfo:
    tokenizer: Any
    model_path: str
    tokenizer_path: str
    context_length: int
    vocab_size: int
    max_total_num_tokens: int
    moe: bool
    lora_enabled: bool

    @classmethod
    def of_runner(cls, runner: Any) -> EngineInfo:
        return cls(tokenizer=runner.tokenizer, model_path=str(runner.model_path),
                   tokenizer_path=str(runner.tokenizer_path),
                   context_length=runner.context_length, vocab_size=runner.vocab_size,
                   max_total_num_tokens=runner.max_total_num_tokens,
                   moe=runner.spec.moe is not None, lora_enabled=runner.lora is not None)

    def facts(self) -> dict[str, Any]:
        """Everything but the tokenizer, as JSON (the scheduler process sends it at start)."""
        return {k: v for k, v in self.__dict__.items() if k != "tokenizer"}

    @classmethod
    def from_facts(cls, facts: dict[str, Any], *, tokenizer: Any = None) -> EngineInfo:
        """`tokenizer`: the one of facts' tokenizer_path, loaded already (else loaded here)."""
        from pathlib import Path

        from rltool.engine.loading import load_tokenizer

        if tokenizer is None:
            tokenizer = load_tokenizer(Path(facts["tokenizer_path"]))
        return cls(tokenizer=tokenizer, **facts)


class LocalLink:
    """The scheduler thread of this process. `submit` raises its refusals (QueueFullError,
    BadInputError, EngineError) at once; requests' callbacks run on the scheduler thread."""

    def __init__(self, ops: EngineOps):
        self.ops = ops
        self.sched = ops.sched
        self.runner = ops.runner

    def submit(self, reqs: list[Request], *, on_refused: Callable[[Exception], None]) -> None:
        self.sched.submit(reqs)

    def abort(self, rids: list[str]) -> concurrent.futures.Future:
        sched = self.sched
        return sched.call(lambda: sched.abort_requests(rids))

    async def call(self, op: str, /, **kwargs: Any) -> Any:
        return await getattr(self.ops, op)(**kwargs)

    @property
    def alive(self) -> bool:
        return self.sched.alive

    @property
    def weight_version(self) -> str:
        return self.runner.weight_version

    @property
    def lora_names(self) -> Any:
        """What checks a request's lora_path (None without --enable-lora)."""
        return self.runner.lora

    def request_stop(self) -> None:
        self.sched.request_stop()
