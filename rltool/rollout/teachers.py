"""Engine-mode on-policy distillation: teacher engines score the student's sampled tokens.

Each finished sample's prompt + response goes to its teacher engine(s) (`--opd-teacher
[NAME=]URL[@WEIGHT]`, routed by `--opd-teacher-route FIELD` or mixed by weight) with
`max_new_tokens` 0, `return_logprob` and `logprob_start_len` = prompt length - 1, up to
`--samples-per-request` samples in one batched `/generate` (lists of input_ids, sampling_params
and logprob_start_len): the engine's `input_token_logprobs` then hold, after SGLang's leading null, the
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


async def _score_batch(client: Any, samples: list[Sample], *,
                       temperature: float) -> list[list[float]]:
    """The teacher's logprobs of each sample's response tokens (every sample has some), from one
    batched /generate."""
    out = await client.generate({
        "input_ids": [s.prompt_token_ids + s.response_token_ids for s in samples],
        "sampling_params": [{"max_new_tokens": 0, "temperature": temperature}] * len(samples),
        "return_logprob": True,
        "logprob_start_len": [len(s.prompt_token_ids) - 1 for s in samples]})
    if not isinstance(out, list) or len(out) != len(samples):
        count = len(out) if isinstance(out, list) else 1
        raise EngineError(f"teacher {client.url}: {count} outputs for a batch of {len(samples)}")
    return [_response_logprobs(client, s, o) for s, o in zip(samples, out)]


def _response_logprobs(client: Any, sample: Sample, out: dict[str, Any]) -> list[float]:
    n = len(sample.response_token_ids)
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
                  concurrency: int, samples_per_request: int) -> dict[str, float]:
    """Set every sample's teacher_logprobs; returns `opd/reverse_kl/NAME` per teacher and
    `opd/reverse_kl` (masked mean of rollout - teacher logprob: the sampled estimate).
    At most `concurrency` bodies of `samples_per_request` samples in flight per teacher."""
    from rltool.rollout.client import EngineClient

    teachers = parse_teacher_specs(specs)
    plans = [assignments(teachers, route, s.metadata, uid=s.uid) for s in samples]

    async def main() -> dict[str, list[list[float] | None]]:
        clients = {t.name: EngineClient(t.location, api_key=api_key, timeout_s=timeout_s,
                                        keepalive=concurrency) for t in teachers}
        try:
            gate = asyncio.Semaphore(concurrency * len(teachers))

            async def batch(name: str, chunk: list[Sample]) -> list[list[float]]:
                async with gate:
                    return await _score_batch(clients[name], chunk, temperature=temperature)

            per_teacher: dict[str, list[list[float] | None]] = {}
            for t in teachers:
                wanted = [any(x.name == t.name for x, _ in plan) for plan in plans]
                todo = [i for i, (s, w) in enumerate(zip(samples, wanted))
                        if w and s.response_token_ids]
                chunks = [todo[k:k + samples_per_request]
                          for k in range(0, len(todo), samples_per_request)]
                scored = await asyncio.gather(*(batch(t.name, [samples[i] for i in c])
                                                for c in chunks))
                got = {i: lp for c, lps in zip(chunks, scored) for i, lp in zip(c, lps)}
                per_teacher[t.name] = [got.get(i, []) if w else None
                                       for i, w in enumerate(wanted)]
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
