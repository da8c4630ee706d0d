"""The fused sampler on a CUDA GPU: every sampling parameter through the compiled Triton kernel.

A filtered row's token is the plain kernel's draw over the logits with the reference's removed
tokens at -inf (the same race keys, bit for bit); plain rows draw the same token in a filtered
batch; the draw logits and the kernel captured in a CUDA graph give the eager tokens and
logprobs for each parameter; and the engine keeps decode overlap on (CUDA graphs on) for
filtered requests, with the tokens of synchronous decoding.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rltool.engine.sampling import SamplingParams
from rltool.logprobs import effective_temperature
from tests.helpers.fused_sampling import STOP, decode_filtered, ref_removed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

V = 4000
CASES = {  # name: (params, suppressed ids)
    "top_k": (SamplingParams(top_k=20), []),
    "top_p": (SamplingParams(top_p=0.7), []),
    "min_p": (SamplingParams(min_p=0.1, temperature=0.8), []),
    "logit_bias": (SamplingParams(logit_bias={"3": 8.0, "11": -100.0}), []),
    "suppressed": (SamplingParams(), [0, 5, 9]),
    "combined": (SamplingParams(top_k=50, top_p=0.9, min_p=0.02, temperature=0.7,
                                logit_bias={"4": 4.0}), [1, 2]),
    "greedy_bias": (SamplingParams(temperature=0.0, logit_bias={"8": 60.0}), []),
    "plain": (SamplingParams(), []),
}


def _batch(rows_per_case: int = 8):
    params = [p for p, _ in CASES.values() for _ in range(rows_per_case)]
    suppressed = [s for _, s in CASES.values() for _ in range(rows_per_case)]
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(len(params), V, device="cuda", generator=g) * 3
    seeds = [(7919 * i + 13) % (2**31 - 1) for i in range(len(params))]
    return logits, params, suppressed, seeds


def _kernel_args(params, seeds):
    temps = torch.tensor([effective_temperature(p.temperature) for p in params], device="cuda")
    return (temps, torch.tensor(seeds, dtype=torch.int32, device="cuda"),
            torch.tensor([p.greedy for p in params], dtype=torch.int32, device="cuda"))


def test_filtered_rows_are_the_plain_race_over_the_allowed_tokens():
    from rltool.engine.batch_sampling import sample_batch
    from rltool.engine.sampling_kernel import sample_rows

    logits, params, suppressed, seeds = _batch()
    B = len(params)
    drawn = sample_batch(logits, params, generators=[None] * B, suppressed=suppressed,
                         top_n=[0] * B, token_ids=[None] * B, seeds=seeds, use_kernel=True)
    masked = logits.clone()
    host = logits.double().cpu().numpy()
    for i, (p, sup) in enumerate(zip(params, suppressed)):
        for tok, bias in (p.logit_bias or {}).items():
            host[i, int(tok)] += bias
            masked[i, int(tok)] += bias
        masked[i, sup] = float("-inf")
        host[i, sup] = -np.inf
        if p.needs_filter:
            z = host[i] / effective_temperature(p.temperature)
            probs = np.exp(z - z.max())
            masked[i, torch.from_numpy(ref_removed(probs / probs.sum(), p)).cuda()] = float("-inf")
    want, _ = sample_rows(masked, *_kernel_args(params, seeds))
    assert drawn.tokens == want.tolist()
    temps = _kernel_args(params, seeds)[0]
    ref_lp = torch.log_softmax(logits / temps[:, None], dim=-1)
    got = torch.tensor(drawn.logprobs, device="cuda", dtype=torch.float32)
    assert torch.allclose(got, ref_lp.gather(1, want[:, None]).squeeze(1), atol=1e-4)
    plain, _ = sample_rows(logits, *_kernel_args(params, seeds))
    at = list(CASES).index("plain") * 8  # _batch's rows per case
    rows = list(range(at, at + 8))
    assert [drawn.tokens[i] for i in rows] == plain[rows].tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_captured_sampling_equals_eager(case):
    """draw_logits and the kernel replayed from a CUDA graph over new logits (and a new stop-id
    mask) give the eager tokens and logprobs."""
    from rltool.engine.batch_sampling import DrawParams, draw_logits
    from rltool.engine.sampling_kernel import sample_rows

    p, sup = CASES[case]
    B = 16
    params = [p] * B
    temps = [effective_temperature(p.temperature)] * B
    draw = DrawParams.build(params, temps=temps, stop_ids=[sup] * B, vocab=V,
                            device=torch.device("cuda"))
    args = _kernel_args(params, list(range(100, 100 + B)))
    static = torch.randn(B, V, device="cuda")
    suppress = torch.ones(B, dtype=torch.bool, device="cuda")

    def step():
        race = None if draw is None else draw_logits(static, draw, suppress)
        return sample_rows(static, *args, draw=race)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compiles the kernels
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for k in range(3):
        g = torch.Generator(device="cuda").manual_seed(k)
        static.copy_(torch.randn(B, V, device="cuda", generator=g) * 3)
        suppress.copy_(torch.arange(B, device="cuda") % 2 == k % 2)
        graph.replay()
        eager = step()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1]), (case, k)


def test_decode_overlap_stays_on_with_filtered_sampling_on_cuda(tiny_model_dir):
    """Filtered requests decode in overlapped blocks with CUDA graphs on, with the tokens of
    synchronous decoding (the same batch shapes: the same graphs)."""
    overlapped, blocks = decode_filtered(tiny_model_dir, device="cuda", overlap=True, steps=2,
                                         cuda_graph=True)
    synchronous, sync_blocks = decode_filtered(tiny_model_dir, device="cuda", overlap=False,
                                               steps=1, cuda_graph=True)
    assert blocks.launches > 0 and blocks.draw_launches > 0 and sync_blocks.launches == 0
    for (toks, lps), (want_toks, want_lps) in zip(overlapped, synchronous):
        assert toks == want_toks
        assert np.allclose(lps, want_lps, atol=1e-4)
    biased = overlapped[2][0]
    assert len(biased) == 4 and STOP not in biased[:3] and biased[3] == STOP, biased


GRAPH_PARAMS = {  # name: the four requests' params (rltool.engine.decode_sample's test cases)
    "plain": [SamplingParams(temperature=t) for t in (1.0, 0.6, 0.0, 1.3)],
    "mixed": [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=20),
              SamplingParams(top_p=0.7, min_p=0.05, temperature=0.8)],
    "bias_min_new": [SamplingParams(), SamplingParams(logit_bias={"3": 4.0, "20": -2.0}),
                     SamplingParams(min_new_tokens=3, temperature=0.7, stop_token_ids=[4, 9]),
                     SamplingParams(temperature=0.0, logit_bias={"7": 1.0})],
}


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("case", sorted(GRAPH_PARAMS))
def test_sampling_in_the_decode_graph_draws_the_eager_tokens(tiny_model_dir, case, steps):
    """Seeded requests with every sampling parameter: sampled inside the decode CUDA graph,
    inside the eager forward (the same body, no graphs) and after the graph's forward (the
    separate sampler launch) give the same tokens and logprobs; the engine's counters say the
    plain and the biased / min_new_tokens batches' steps were graphed and that a batch with
    top-k / top-p / min-p fell back."""
    from tests.helpers.graph_sampling import serve_seeded

    params = GRAPH_PARAMS[case]
    runs = {name: serve_seeded(tiny_model_dir, params, device="cuda", steps=steps, **kw)
            for name, kw in {"graph": dict(graph_sampling=True, cuda_graph=True),
                             "eager": dict(graph_sampling=True, cuda_graph=False),
                             "apart": dict(graph_sampling=False, cuda_graph=True)}.items()}
    want = runs["apart"][0]
    for name in ("graph", "eager"):
        for (toks, lps), (want_toks, want_lps) in zip(runs[name][0], want):
            assert toks == want_toks, (name, toks, want_toks)
            assert np.allclose(lps, want_lps, atol=1e-6, rtol=0), name
    graphed = runs["graph"][1].stats()
    assert runs["apart"][1].stats()["num_graph_sampled_steps"] == 0
    assert runs["eager"][1].stats()["num_graph_sampled_steps"] == 0
    if case != "mixed":
        assert graphed["num_graph_sampled_steps"] > 0 and graphed["num_eager_sampled_steps"] == 0
    else:
        assert graphed["num_eager_sampled_steps"] > 0


def test_a_steady_decode_step_does_not_synchronize(tiny_model_dir):
    """The scheduler's decode steps (overlapped, sampled inside the CUDA graph) run with
    torch.cuda.set_sync_debug_mode("error") once the batch is steady: no step waits for the
    device through an implicit synchronisation (a .item(), a pageable copy)."""
    from rltool.engine.paged_runner import PagedRunner
    from rltool.engine.paged_scheduler import PagedScheduler
    from rltool.engine.request import Request

    runner = PagedRunner(tiny_model_dir, device="cuda", dtype="fp32", max_running=4,
                         page_size=4, max_total_tokens=1024)
    sched = PagedScheduler(runner, max_running=4, num_continuous_decode_steps=2)
    reqs = [Request(rid=f"s{i}", prompt_ids=[3 + i, 8, 1], return_logprob=True,
                    params=SamplingParams(temperature=1.0, max_new_tokens=100,
                                          ignore_eos=True))
            for i in range(4)]
    sched.submit(reqs)
    sched.queue.wait_for_work(sched.batch.can_step)  # the arrivals join `waiting`
    for _ in range(4):  # admission, prefill, the first blocks
        sched.batch.step()
    before = sched.stats()["num_graph_sampled_steps"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            sched.batch.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert sched.stats()["num_graph_sampled_steps"] - before == 16
    assert all(len(r.output_ids) >= 16 and not r.finished for r in reqs)
    sched.batch.blocks.drain()
