"""Variable-length prefill attention (rltool.engine.varlen_attention) in fp32 on CPU: one call over
fresh chunks and chunks over a cached prefix equals each sequence's causal attention computed
alone in float64 with plain loops, and the engine's packed prefill of such a step gives the
logits of one unpadded pass over each whole sequence."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from rltool.engine import varlen_attention
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams, make_generator
from tests.helpers.scheduling import run_in_two_waves

H, KVH, D = 4, 2, 8


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, KVH, D]: causal attention, float64."""
    n, out = q.shape[0], torch.zeros(q.shape, dtype=torch.float64)
    scale = D ** -0.5
    for i in range(n):
        for h in range(H):
            g = h // (H // KVH)
            scores = [float(q[i, h].double() @ k[j, g].double()) * scale
                      for j in range(start + i + 1)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for j, w in enumerate(weights):
                out[i, h] += w / total * v[j, g].double()
    return out


def test_one_call_equals_each_sequence_alone():
    """Fresh chunks of different lengths, then two continuations (3 tokens over 5 cached, 6 over
    4), in one packed step."""
    gen = torch.Generator().manual_seed(0)
    layout = [(7, 0), (1, 0), (7, 0), (4, 0), (3, 5), (6, 4)]  # (chunk length, cached tokens)
    seqs = [(torch.randn(s + n, H, D, generator=gen), torch.randn(s + n, KVH, D, generator=gen),
             torch.randn(s + n, KVH, D, generator=gen)) for n, s in layout]
    q = torch.cat([sq[s:] for (sq, _, _), (n, s) in zip(seqs, layout)])
    k = torch.cat([sk[s:] for (_, sk, _), (n, s) in zip(seqs, layout)])
    v = torch.cat([sv[s:] for (_, _, sv), (n, s) in zip(seqs, layout)])
    pool_k, pool_v, chunks, offset = [], [], [], 0
    for (_, sk, sv), (n, s) in zip(seqs, layout):
        slots = None
        if s:  # its whole sequence is read back from the pool (here: a tensor of its own)
            first = sum(len(x) for x in pool_k)
            slots = list(range(first, first + s + n))
            pool_k.append(sk)
            pool_v.append(sv)
        chunks.append((offset, n, s, slots))
        offset += n
    plan = varlen_attention.plan(chunks, num_tokens=offset, device=torch.device("cpu"),
                                 flash=False)
    assert plan.slots.tolist() == list(range(8 + 10))
    assert plan.cu_q.tolist() == [0, 7, 8, 15, 19, 22, 28]
    assert plan.cu_k.tolist() == [0, 7, 8, 15, 19, 27, 37]
    out = varlen_attention.attend(plan, q, k, v, scale=D ** -0.5,
                                  pool_kv=(torch.cat(pool_k), torch.cat(pool_v)))
    for (sq, sk, sv), (n, s), (o, *_) in zip(seqs, layout, chunks):
        want = reference(sq[s:], sk, sv, s)
        assert torch.allclose(out[o:o + n].double(), want, atol=1e-5, rtol=0), (n, s)


@pytest.mark.parametrize("attention", ["grouped", "varlen"])
def test_packed_prefill_with_cached_prefixes_matches_full_passes(tiny_model_dir, attention):
    """Two prompts fill the pool; a second step prefills their continuations (one short, one past
    DECODE_QUERIES) beside two fresh prompts of different lengths: every chunk's last logits
    equal those of an unpadded pass over its whole sequence."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=8,
                         page_size=4, max_total_tokens=2048, prefill_attention=attention)
    gen = torch.Generator().manual_seed(1)
    seq = {rid: torch.randint(3, 40, (n,), generator=gen).tolist()
           for rid, n in [("a", 90), ("b", 20), ("c", 13), ("d", 5)]}
    runner.prefill([("a", seq["a"][:10], 0), ("b", seq["b"][:12], 0)], want=[False, False])
    chunks = [("c", seq["c"], 0), ("a", seq["a"][10:], 10), ("d", seq["d"], 0),
              ("b", seq["b"][12:], 12)]
    logits = runner.prefill(chunks, want=[True] * 4)
    for row, (rid, *_) in zip(logits, chunks):
        full = runner.full_pass_logits(seq[rid] + [0], start=len(seq[rid]))[0]
        assert torch.allclose(row, full, atol=1e-5, rtol=0), rid


def _generate(model_dir, attention: str) -> list[tuple[list[int], list[float]]]:
    """Seeded sampled requests through the scheduler: prompts of several lengths, a shared
    prefix (cache hits continue it) and a prompt longer than a chunk."""
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=8, page_size=4,
                         max_total_tokens=4096, prefill_attention=attention)
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=48, chunked_prefill_size=24)
    shared = list(range(3, 15))
    prompts = [shared + [20, 21], [5, 6, 7], shared + [22, 23, 24, 25, 26], list(range(3, 40)),
               [9] * 11, shared + [27]]
    done = threading.Event()
    reqs = [Request(rid=f"r{i}", prompt_ids=p, return_logprob=True,
                    generator=make_generator(100 + i),
                    on_finish=lambda _: done.set() if all(r.finished for r in reqs) else None,
                    params=SamplingParams(max_new_tokens=6, temperature=0.8, ignore_eos=True))
            for i, p in enumerate(prompts)]
    run_in_two_waves(sched, reqs, done)
    return [(r.output_ids, r.output_logprobs) for r in reqs]


def test_varlen_prefill_gives_the_grouped_tokens(tiny_model_dir):
    """The engine's tokens for seeded sampled requests do not depend on the prefill attention;
    their logprobs agree within 1e-5 (fp32)."""
    grouped, varlen = _generate(tiny_model_dir, "grouped"), _generate(tiny_model_dir, "varlen")
    for (tok_g, lp_g), (tok_v, lp_v) in zip(grouped, varlen):
        assert tok_g == tok_v
        assert torch.allclose(torch.tensor(lp_g), torch.tensor(lp_v), atol=1e-5, rtol=0)


def test_unknown_prefill_attention_is_refused(tiny_model_dir):
    from rltool.errors import BadInputError

    with pytest.raises(BadInputError, match="--prefill-attention 'flash'; choose grouped or"):
        PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", prefill_attention="flash")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_varlen_matches_the_masked_path_on_cuda():
    """bf16 on CUDA: torch's variable-length flash attention, causal aligned to the end of each
    key segment, equals the masked SDPA of the same plan (continuations included)."""
    gen = torch.Generator().manual_seed(0)
    layout = [(7, 0), (1, 0), (33, 0), (3, 5), (70, 40)]
    chunks, offset, first = [], 0, 0
    for n, s in layout:
        chunks.append((offset, n, s, list(range(first, first + s + n)) if s else None))
        offset, first = offset + n, first + (s + n if s else 0)
    q, k, v = (torch.randn(offset, h, D, generator=gen).cuda().bfloat16() for h in (H, KVH, KVH))
    pool = [torch.randn(first, KVH, D, generator=gen).cuda().bfloat16() for _ in range(2)]
    outs = [varlen_attention.attend(varlen_attention.plan(chunks, num_tokens=offset,
                                                          device=q.device, flash=flash),
                                    q, k, v, scale=D ** -0.5, pool_kv=(pool[0], pool[1]))
            for flash in (True, False)]
    assert torch.allclose(outs[0].float(), outs[1].float(), atol=2e-2, rtol=0)
