"""Engine-mode on-policy distillation: teacher engines score the student's sampled tokens.

Each finished sample's prompt + response goes to its teacher engine(s) (`--opd-teacher
[NAME=]URL[@WEIGHT]`, routed by `--opd-teacher-route FIELD` or mixed by weight) as one
`/generate` call with `max_new_tokens` 0, `return_logprob` and `logprob_start_len` = prompt
length - 1: the engine's `input_token_logprobs` then hold, after SGLang's leading null, the
teacher's log-probability of every response token at the sampling temperature (the
rltool.logprobs convention). The mix sum_j w_j log q_j goes into the shard's `teacher_logprobs`.
A teacher whose tokenizer (hash of the directory its /get_model_info names) differs from the
student's is refused before any request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rltool.data.teachers import TeacherSpec, assignments, parse_teacher_specs
from rltool.errors import BadInputError, EngineError
from rltool.rollout.generate import Sample


async def _tokenizer_hash(client: Any, spec: TeacherSpec) -> str:
    from rltool.data.tokenizer import tokenizer_hash

    info = await client.get_model_info()
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path or not Path(path).is_dir():
        raise BadInputError(f"--opd-teacher {spec.name}={spec.location}: it reports tokenizer_path "
                            f"{path!r}, not a local directory, so its tokenizer cannot be checked "
                            "against the student's; serve the teacher where this host sees its "
                            "files")
    return tokenizer_hash(path)


async def _score_one(client: Any, sample: Sample, *, temperature: float) -> list[float]:
    n = len(sample.response_token_ids)
    if n == 0:
        return []
    out = await client.generate({
        "input_ids": sample.prompt_token_ids + sample.response_token_ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
        "return_logprob": True, "logprob_start_len": len(sample.prompt_token_ids) - 1})
    entries = out.get("meta_info", {}).get("input_token_logprobs") or []
    values = [e[0] for e in entries[1:]]
    if len(values) != n or any(v is None for v in values):
        raise EngineError(f"teacher {client.url}: {len(values)} input logprobs for the {n} "
                          f"response tokens of sample {sample.uid}; the engine must honour "
                          "logprob_start_len (SGLang's API)")
    return [float(v) for v in values]


def check_teachers(specs: list[str], *, route: str | None, prompts: list[Any],
                   student_tokenizer_hash: str, api_key: str | None) -> None:
    """Before any generation: every prompt's route names a teacher, and every teacher engine
    shares the student's tokenizer (BadInputError otherwise)."""
    from rltool.rollout.client import EngineClient

    teachers = parse_teacher_specs(specs)
    for p in prompts:
        assignments(teachers, route, p.metadata, uid=f"of prompt {p.prompt_id}")

    async def main() -> list[str]:
        clients = [EngineClient(t.location, api_key=api_key, timeout_s=30.0) for t in teachers]
        try:
            return await asyncio.gather(*(_tokenizer_hash(c, t)
                                          for c, t in zip(clients, teachers)))
        finally:
            for c in clients:
                await c.aclose()

    for t, h in zip(teachers, asyncio.run(main())):
        if h != student_tokenizer_hash:
            raise BadInputError(f"--opd-teacher {t.name}={t.location}: its tokenizer ({h}) "
                                f"differs from the student's ({student_tokenizer_hash}); a teacher "
                                "must share the student's tokenizer")


def score_samples(samples: list[Sample], *, specs: list[str], route: str | None,
                  temperature: float, api_key: str | None, timeout_s: float,
                  concurrency: int) -> dict[str, float]:
    """Set every sample's teacher_logprobs; returns `opd/reverse_kl/NAME` per teacher and
    `opd/reverse_kl` (masked mean of rollout - teacher logprob: the sampled estimate)."""
    from rltool.rollout.client import EngineClient

    teachers = parse_teacher_specs(specs)
    plans = [assignments(teachers, route, s.metadata, uid=s.uid) for s in samples]

    async def main() -> dict[str, list[list[float] | None]]:
        clients = {t.name: EngineClient(t.location, api_key=api_key, timeout_s=timeout_s)
                   for t in teachers}
        try:
            gate = asyncio.Semaphore(concurrency * len(teachers))

            async def one(name: str, sample: Sample) -> list[float]:
                async with gate:
                    return await _score_one(clients[name], sample, temperature=temperature)

            per_teacher: dict[str, list[list[float] | None]] = {}
            for t in teachers:
                wanted = [any(x.name == t.name for x, _ in plan) for plan in plans]
                scored = await asyncio.gather(*(one(t.name, s) for s, w in zip(samples, wanted)
                                                if w))
                it = iter(scored)
                per_teacher[t.name] = [next(it) if w else None for w in wanted]
            return per_teacher
        finally:
            for c in clients.values():
                await c.aclose()

    per_teacher = asyncio.run(main())
    metrics = {f"opd/reverse_kl/{t.name}": _masked_mean(
        [(s, lp) for s, lp in zip(samples, per_teacher[t.name]) if lp is not None])
        for t in teachers}
    for i, (s, plan) in enumerate(zip(samples, plans)):
        s.teacher_logprobs = [sum(w * per_teacher[t.name][i][j] for t, w in plan)
                              for j in range(len(s.response_token_ids))]
    metrics["opd/reverse_kl"] = _masked_mean([(s, s.teacher_logprobs) for s in samples])
    return metrics


def _masked_mean(scored: list[tuple[Sample, list[float]]]) -> float:
    """Masked token mean of rollout logprob - teacher logprob (the sampled reverse KL)."""
    total = sum((r - q) * m for s, lp in scored
                for r, q, m in zip(s.rollout_logprobs, lp, s.loss_mask))
    count = sum(sum(s.loss_mask) for s, _ in scored)
    return total / max(count, 1)
