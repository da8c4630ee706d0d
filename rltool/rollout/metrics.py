"""Rollout and eval metrics (slime's names where one exists) and the rollout progress bar."""

from __future__ import annotations

import math
import time
from typing import Any

from rltool.rollout.generate import Sample


def rollout_metrics(groups: list[list[Sample]], *, counts: dict[str, int], output_tokens: int,
                    elapsed_s: float, redispatched: int) -> dict[str, Any]:
    samples = [s for g in groups for s in g]
    n = len(samples)
    lengths = [len(s.response_token_ids) for s in samples]
    rewards = [s.reward for s in samples]
    masked_logprobs = [lp for s in samples for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m]
    versions = [v for s in samples for v in s.weight_versions if v >= 0]
    zero_std = sum(1 for g in groups if len(g) > 1 and len({s.reward for s in g}) == 1)
    out: dict[str, Any] = {
        "rollout/num_samples": n,
        "rollout/num_groups": len(groups),
        "rollout/raw_reward": _mean(rewards),
        "rollout/raw_reward_std": _std(rewards),
        "rollout/response_len/mean": _mean(lengths),
        "rollout/response_len/max": max(lengths, default=0),
        "rollout/response_len/min": min(lengths, default=0),
        "rollout/log_probs": _mean(masked_logprobs),
        "rollout/zero_std/count": zero_std,
        "rollout/weight_version/min": min(versions, default=-1),
        "rollout/weight_version/max": max(versions, default=-1),
        "rollout/redispatched_requests": redispatched,
        "rollout/dynamic_filter/drop_zero_std": counts.get("dropped_equal_reward", 0),
        "rollout/dynamic_filter/over_sampled_groups": counts.get("over_sampled_groups", 0),
        "rollout/dynamic_filter/aborted_groups": counts.get("aborted_extra_groups", 0),
        "rollout/dynamic_filter/prompts_started": counts.get("fresh_groups", 0),
        "rollout/partial/carried_in_groups": counts.get("carried_in_groups", 0),
        "rollout/partial/carried_out_groups": counts.get("carried_out_groups", 0),
        "rollout/reward_calls": counts.get("reward_calls", 0),
        "rollout/failed_rewards": counts.get("failed_rewards", 0),
        "perf/rollout_time": elapsed_s,
        "perf/output_tokens": output_tokens,
        "perf/tokens_per_sec": output_tokens / elapsed_s if elapsed_s > 0 else 0.0,
    }
    episodes = [s for s in samples if s.turn_starts is not None]
    if episodes or any(s.finish_reason.startswith("env_") for s in samples):
        out["rollout/env/episodes"] = len(episodes)
        out["rollout/env/turns/mean"] = _mean([len(s.turn_starts) for s in episodes])
        out["rollout/env/failed"] = sum(s.finish_reason.startswith("env_") for s in samples)
        out["rollout/env/timeouts"] = sum(s.finish_reason.startswith("env_timeout")
                                          for s in samples)
    for status in ("truncated", "aborted", "failed"):
        out[f"rollout/{status}_ratio"] = (sum(s.status == status for s in samples) / n) if n else 0.0
    return out


def eval_metrics(groups: list[list[Sample]], *, pass_threshold: float, elapsed_s: float,
                 output_tokens: int) -> dict[str, Any]:
    """Mean reward, pass@1 and pass@k (k = samples per prompt; unbiased estimator of Chen et al.),
    truncated ratio. A sample passes when its reward >= pass_threshold."""
    samples = [s for g in groups for s in g]
    n = len(samples)
    k = min((len(g) for g in groups), default=0)
    pass1, passk = [], []
    for g in groups:
        c = sum(s.reward >= pass_threshold for s in g)
        pass1.append(c / len(g))
        passk.append(_pass_at_k(len(g), c, k))
    return {
        "eval/mean_reward": _mean([s.reward for s in samples]),
        "eval/pass@1": _mean(pass1),
        "eval/pass@k": _mean(passk),
        "eval/k": k,
        "eval/num_prompts": len(groups),
        "eval/num_samples": n,
        "eval/truncated_ratio": (sum(s.status == "truncated" for s in samples) / n) if n else 0.0,
        "eval/failed_ratio": (sum(s.status == "failed" for s in samples) / n) if n else 0.0,
        "eval/response_len/mean": _mean([len(s.response_token_ids) for s in samples]),
        "perf/eval_time": elapsed_s,
        "perf/tokens_per_sec": output_tokens / elapsed_s if elapsed_s > 0 else 0.0,
    }


def _pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: list[float]) -> float:
    if not xs:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


class RolloutProgress:
    """Samples done of the step, with prompts (groups) done and output tokens/s alongside
    (rltool.progress: a bar on a terminal, periodic lines otherwise, nothing when quiet)."""

    def __init__(self, *, total_groups: int, total_samples: int, quiet: bool, label: str):
        from rltool.progress import Progress

        self._progress = Progress(f"{label} samples", total=total_samples, unit="samples",
                                  quiet=quiet)
        self.total_groups = total_groups
        self._groups = 0
        self._tokens = 0

    def __enter__(self) -> "RolloutProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)

    def group_done(self) -> None:
        self._groups += 1
        self._progress.advance(0, info=self._info())

    def samples_done(self, count: int, *, tokens: int) -> None:
        self._tokens += tokens
        self._progress.advance(count, info=self._info())

    def _info(self) -> str:
        elapsed = time.monotonic() - self._progress.started
        rate = f", {self._tokens / elapsed:,.0f} out tok/s" if elapsed > 0 else ""
        return f"prompts {self._groups}/{self.total_groups}{rate}"
