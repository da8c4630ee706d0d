"""On-policy distillation (OPD): the student's per-token reverse KL to a teacher, three estimators.

The student pi_s samples x_t; at every response position t (context c_t) the target is
KL_t = KL(pi_s(.|c_t) || pi_T(.|c_t)) = sum_v p_s(v) (log p_s(v) - log p_T(v)).

- sampled: the one-sample Monte-Carlo estimate log pi_s(x_t) - log pi_T(x_t) (unbiased, since
  x_t ~ pi_s); it enters the advantage as a dense penalty, A_t <- A_t - beta * estimate
  (`shape_advantages`), and its gradient is the policy gradient's.
- topk: the KL between both distributions restricted to a token set S_t (the student's k most
  likely tokens) and renormalised over it: p~(v) = p(v) / sum_{u in S_t} p(u) for each side;
  `topk_kl` of the student's live logits, a loss term with an analytic gradient.
- full: the exact KL_t from both full distributions, accumulated over vocabulary chunks so no
  second [T, V] temporary is held (`full_kl`), a loss term.

Several teachers mixed with weights w_j (sum 1) are one teacher: sum_j w_j KL(p || q_j) =
sum_v p(v) (log p(v) - sum_j w_j log q_j(v)), so every estimator takes the weighted sum of the
teachers' (renormalised) log-probabilities.
"""

from __future__ import annotations

import torch

VOCAB_CHUNK = 8192


def shape_advantages(advantages: list[torch.Tensor], student_logprobs: list[torch.Tensor],
                     teacher_logprobs: list[torch.Tensor], *, kl_coef: float
                     ) -> list[torch.Tensor]:
    """A_t - kl_coef * (log pi_s(x_t) - log pi_T(x_t)) per sample (the sampled estimator)."""
    return [a - kl_coef * (s - t) for a, s, t in zip(advantages, student_logprobs,
                                                     teacher_logprobs)]


def renormalise(logprobs: torch.Tensor) -> torch.Tensor:
    """log p~ over the last dimension: log p - logsumexp(log p) (a distribution over the set)."""
    return logprobs - torch.logsumexp(logprobs, dim=-1, keepdim=True)


def topk_kl(student_logits: torch.Tensor, token_ids: torch.Tensor,
            teacher_logprobs: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """Per-position KL over the set `token_ids` [T, k], both sides renormalised over it.

    student_logits [T, V] (raw, scaled by `temperature` here); teacher_logprobs [T, k]: the
    teacher's log-probabilities at `token_ids` (full-vocabulary or already renormalised: the
    renormalisation is the same). With k = V this is `full_kl`."""
    scaled = student_logits.float() / temperature
    student = renormalise(scaled.gather(-1, token_ids.long()))
    teacher = renormalise(teacher_logprobs.float())
    return (student.exp() * (student - teacher)).sum(-1)


def full_kl(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor, *, temperature: float,
            chunk: int = VOCAB_CHUNK) -> torch.Tensor:
    """Exact per-position KL(p_s || p_T) [T] from student logits [T, V] and the teacher's
    log-probabilities [T, V], summed over vocabulary chunks of `chunk` entries."""
    scaled = student_logits.float() / temperature
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    total = torch.zeros(scaled.shape[:-1], dtype=scaled.dtype, device=scaled.device)
    for lo in range(0, scaled.shape[-1], chunk):
        log_p = scaled[..., lo:lo + chunk] - lse
        total = total + (log_p.exp() * (log_p - teacher_logprobs[..., lo:lo + chunk].float())
                         ).sum(-1)
    return total
