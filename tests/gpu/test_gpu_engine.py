"""The paged engine on a CUDA GPU: the engine's model (dense and qwen3_moe) against transformers on
the same GPU (teacher-forced, fp32 within 1e-5, bf16 within 2e-2), CUDA-graph replay against
eager decode (identical), multi-step decode against one step per iteration (identical), memory
release and resume (free memory returns, generation repeats), pause modes, prefix reuse with a
copied page, the engine's Triton kernels compiled once for batches of any size.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19, 25, 6, 13, 1, 28, 12, 15, 20]
TOL = {"fp32": 1e-5, "bf16": 2e-2}


def runner_for(model_dir, dtype, **kw):
    opts = dict(device="cuda", dtype=dtype, max_running=8, page_size=4, max_total_tokens=4096,
                cuda_graph_max_bs=8)
    opts.update(kw)
    return PagedRunner(model_dir, **opts)


def assert_teacher_forced(runner, ref, tol):
    """`runner`'s log-softmax over SEQ within `tol` of `ref` (the reference's, on the same
    device): a full pass, and a paged prefill of 12 tokens followed by graph-replayed decode
    steps, teacher-forced."""
    full = torch.log_softmax(runner.full_pass_logits(SEQ, start=1), -1)
    assert (full - ref[:-1]).abs().max() <= tol
    got = runner.prefill([("a", SEQ[:12], 0)], want=[True])
    rows = [got[0]]
    for t in range(12, len(SEQ) - 1):
        # .clone(): the graph's output buffer is reused by the next step (and fp32 .float()
        # would return the buffer itself).
        rows.append(runner.decode(["a"], [SEQ[t]])[0].float().clone())
    paged = torch.log_softmax(torch.stack(rows), -1)
    assert (paged - ref[11:-1]).abs().max() <= tol


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_logprobs_match_transformers_on_the_gpu(arch, dtype, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(arch, 0)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).cuda().eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=torch.tensor([SEQ]).cuda()).logits[0].float(), -1)
    assert_teacher_forced(runner_for(model_dir, dtype), ref, TOL[dtype])


def test_graph_replay_equals_eager_decode(tiny_model_dir):
    graphed = runner_for(tiny_model_dir, "bf16")
    eager = runner_for(tiny_model_dir, "bf16", disable_cuda_graph=True)
    assert graphed.graphs and not eager.graphs
    prompts = {"a": SEQ[:5], "b": SEQ[3:14], "c": SEQ[:1]}
    for r in (graphed, eager):
        r.prefill([(rid, p, 0) for rid, p in prompts.items()], want=[False] * 3)
    for step in range(40):  # crosses page and split boundaries
        toks = [(step * 7 + i) % 30 for i in range(3)]
        a = graphed.decode(list(prompts), toks)
        b = eager.decode(list(prompts), toks)
        assert torch.equal(a, b), step


def generate(sched, prompts, **params):
    done, out = threading.Event(), {}

    def on_finish(req):
        out[req.rid] = req
        if len(out) == len(prompts):
            done.set()

    sched.submit([Request(rid=f"q{i}-{sched.next_seq()}", prompt_ids=p, return_logprob=True,
                          on_finish=on_finish,
                          params=SamplingParams(max_new_tokens=12, temperature=0.0,
                                                ignore_eos=True, **params))
                  for i, p in enumerate(prompts)])
    assert done.wait(120)
    return [out[k] for k in sorted(out, key=lambda k: int(k.split("-")[0][1:]))]


def test_release_frees_memory_and_resume_repeats_generation(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2", 0)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    runner = runner_for(model_dir, "bf16", max_total_tokens=None, mem_fraction_static=0.3)
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=64, chunked_prefill_size=32)
    sched.start()
    try:
        prompts = [SEQ[:7], SEQ[2:15], SEQ[:3]]
        first = [r.output_ids for r in generate(sched, prompts)]
        free_loaded, _ = torch.cuda.mem_get_info()
        footprint = free_before - free_loaded
        sched.call(sched.retract_for_release).result()
        sched.call(runner.release).result()
        free_released, _ = torch.cuda.mem_get_info()
        assert free_released - free_loaded >= 0.95 * footprint, (footprint, free_released)
        sched.call(runner.resume).result()
        again = [r.output_ids for r in generate(sched, prompts)]
        assert again == first
    finally:
        sched.stop()


def test_release_and_resume_cycles_leave_no_memory_behind(tiny_model_dir):
    """A resume rebuilds weights, KV pool and decode graphs; cycles after the first leave the
    allocated CUDA memory where the first left it (a fresh capture stream per build left a
    cuBLAS workspace, 32 MiB on Hopper, behind each time)."""
    runner = runner_for(tiny_model_dir, "bf16")
    levels = []
    try:
        for _ in range(4):
            runner.release()
            runner.resume()
            assert runner.decoder.num_graphs() > 0
            torch.cuda.synchronize()
            levels.append(torch.cuda.memory_allocated())
    finally:
        runner.release()
    assert max(levels) - min(levels) < 1 << 20, levels


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes(mode, tiny_model_dir):
    runner = runner_for(tiny_model_dir, "bf16")
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=64, chunked_prefill_size=32)
    sched.start()
    try:
        ref = generate(sched, [SEQ[:6]])[0].output_ids
        done = threading.Event()
        req = Request(rid="long", prompt_ids=SEQ[:6], on_finish=lambda r: done.set(),
                      params=SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True))
        sched.submit([req])
        while len(req.output_ids) < 3:
            time.sleep(0.001)
        sched.call(lambda: sched.pause(mode)).result()
        n = len(req.output_ids)
        if mode == "abort":
            assert done.wait(10) and req.finish_reason["type"] == "abort"
        else:
            for _ in range(20):  # the scheduler loop comes round; a paused one decodes nothing
                sched.call(lambda: None).result()
            assert not done.is_set() and len(req.output_ids) == n
            sched.call(sched.resume_generation).result()
            assert done.wait(60) and len(req.output_ids) == 400
            assert req.output_ids[:12] == ref
        assert not runner.table.entries
    finally:
        sched.stop()


def test_sampling_kernel_distribution_on_the_gpu():
    from rltool.engine.sampling_kernel import sample_rows

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * 60, device="cuda")
    n = 20000  # frequency standard deviation <= 0.0036
    rows = (probs + 1e-30).log().repeat(n, 1) * 0.5  # temperature 0.5 undoes the halving
    toks, lps = sample_rows(rows, torch.full((n,), 0.5, device="cuda"),
                            torch.arange(n, dtype=torch.int32, device="cuda"),
                            torch.zeros(n, dtype=torch.int32, device="cuda"))
    freq = torch.bincount(toks, minlength=64).float() / n
    assert (freq - probs).abs().max() < 0.015, freq[:4]
    assert torch.allclose(lps, probs.log()[toks], atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapped_decoding_equals_step_by_step(temperature, tiny_model_dir):
    """Queuing step N + 1 before reading step N back changes nothing: same tokens, logprobs and
    lengths (requests stopping at different steps, seeded draws keyed by request and step)."""
    outs = []
    for overlap in (True, False):
        runner = runner_for(tiny_model_dir, "bf16")
        # One bucket: overlapped batches keep a stopped row one step longer, and a different
        # padded shape could pick other GEMM kernels (bf16 noise), which is not what is tested.
        runner.decoder.buckets = [8]
        reqs = six_requests(runner, "o", 100, temperature, overlap=overlap)
        outs.append([(r.output_ids, r.output_logprobs) for r in reqs])
        assert all(len(r.output_ids) == 5 + 7 * i for i, r in enumerate(reqs))
    assert outs[0] == outs[1]


def test_prefix_reuse_copies_the_partly_reused_page_on_the_gpu(tiny_model_dir):
    """Copy-on-write of the cached page a prompt ends or leaves the tree in, on CUDA: every cached
    token but the last is reused, greedy outputs and fp32 logprobs (within 1e-5) equal an engine
    without the cache, and every page comes back."""
    from tests.engine.test_prefix_cache import PARTIAL_PROMPTS, cached_and_plain

    runner, sched, _, _, cached = cached_and_plain(tiny_model_dir, PARTIAL_PROMPTS,
                                                   device="cuda")
    assert [r.cached_tokens for r in cached] == [0, 11, 11, 9, 10]
    assert sched.num_prefill_tokens == 12 + 1 + 1 + 1 + 2
    table = runner.table
    assert not table.entries and table.free_pages == table.allocator.num_pages - 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multistep_decode_equals_single_steps(temperature, tiny_model_dir):
    """Blocks of 4 or 7 decode steps per scheduler iteration, replayed from CUDA graphs with the
    advance and the sampler between replays (and 4 eagerly), give the tokens and logprobs of one
    step per iteration exactly; requests stop inside blocks; every page comes back."""
    outs = []
    for steps, graphs in ((1, True), (4, True), (7, True), (4, False)):
        runner = runner_for(tiny_model_dir, "bf16", disable_cuda_graph=not graphs)
        # one padded shape: see test_overlapped_decoding_equals_step_by_step
        runner.decoder.buckets = [8]
        full = runner.free_pages()
        reqs = six_requests(runner, "m", 200, temperature, num_continuous_decode_steps=steps)
        assert runner.free_pages() == full
        assert bool(runner.graphs) == graphs
        outs.append([(r.output_ids, r.output_logprobs) for r in reqs])
        assert all(len(r.output_ids) == 5 + 7 * i for i, r in enumerate(reqs))
    assert all(out == outs[0] for out in outs[1:])


def six_requests(runner, prefix: str, seed: int, temperature: float, **options) -> list:
    """Six seeded requests of 5-40 new tokens (ignore_eos) on a scheduler over `runner` with
    `options`; returns them finished."""
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=64, chunked_prefill_size=32,
                           **options)
    sched.start()
    try:
        done, got = threading.Event(), []
        reqs = [Request(rid=f"{prefix}{i}", prompt_ids=SEQ[i:i + 4 + i], return_logprob=True,
                        generator=torch.Generator().manual_seed(seed + i),
                        on_finish=lambda r: (got.append(r), len(got) == 6 and done.set()),
                        params=SamplingParams(max_new_tokens=5 + 7 * i, ignore_eos=True,
                                              temperature=temperature))
                for i in range(6)]
        sched.submit(reqs)
        assert done.wait(60)
    finally:
        sched.stop()
    return reqs


def compiled_variants(kernel) -> int:
    """How many variants of a Triton kernel have been compiled in this process."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_engine_kernels_compile_once_for_any_batch():
    """Each engine kernel called with fixed shapes but token counts of every parity (1, 5, 16,
    33, 64) and its per-token index rows taken, as the engine takes them, from one packed int64
    tensor (misaligned for odd counts) compiles once: no batch of a running engine waits for
    Triton's compiler because its size is new."""
    from rltool.engine import decode_attention as attention
    from rltool.engine import fp8_gemm, fp8_kernels, fused, sampling_kernel
    from rltool.engine.paged import PageTable, host_tensor

    # 49,152 ids: the sampler splits a row into 48, 24 or 16 chunks across these batches
    hidden, inter, heads, kvh, d, page, vocab = 256, 512, 4, 2, 64, 16, 49_152
    dev, bf16 = "cuda", torch.bfloat16
    table = PageTable(num_pages=512, page_size=page, max_requests=64, max_pages_per_request=8,
                      device=dev)
    for i in range(64):
        table.add(f"r{i}")
        table.extend(f"r{i}", 100)
    table.flush()
    slots = 512 * page
    k_cache, v_cache = (torch.zeros(slots, kvh, d, device=dev, dtype=bf16) for _ in range(2))
    angles = torch.arange(128, device=dev).float()[:, None] / 100 * torch.ones(d, device=dev)
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    kernels = {"add_rms_norm": fused._add_rms_norm, "silu_mul": fused._silu_mul,
               "rope_store": fused._rope_store, "quantize_rows": fp8_kernels.quantize_rows,
               "stage1": attention._stage1, "stage2": attention._stage2,
               "sample_partial": sampling_kernel._partial,
               "sample_combine": sampling_kernel._combine}
    counts = []
    for t in (16, 5, 1, 33, 64):
        x = torch.randn(t, hidden, device=dev, dtype=bf16)
        w = torch.ones(hidden, device=dev, dtype=bf16)
        for block_k in (None, 128):
            fused.add_rms_norm(x, x.clone(), w, 1e-6, block_k)
            fused.silu_mul(torch.randn(t, 2 * inter, device=dev, dtype=bf16), block_k)
        fp8_gemm.quantize_activations(x, 128, rows=fp8_gemm.padded_rows(t))
        meta = host_tensor([list(range(t)), [i % 100 for i in range(t)],
                            [table.entries[f"r{i}"].row for i in range(t)],
                            [100] * t]).to(dev)
        positions, rows, seq_lens = meta[1], meta[2], meta[3]
        q = torch.randn(t, heads, d, device=dev, dtype=bf16)
        k, v = (torch.randn(t, kvh, d, device=dev, dtype=bf16) for _ in range(2))
        fused.rope_store(q, k, v, cos, sin, positions, k_cache=k_cache, v_cache=v_cache,
                         loc=meta[0])
        for block_k in (None, 64):
            attention.decode_attention(q, k_cache, v_cache, req_to_page=table.req_to_page,
                                       rows=rows, seq_lens=seq_lens, page_size=page,
                                       scale=d ** -0.5, num_splits=4, block_k=block_k)
        sampling_kernel.sample_rows(torch.randn(t, vocab, device=dev),
                                    torch.ones(t, device=dev),
                                    torch.arange(t, device=dev, dtype=torch.int32),
                                    torch.zeros(t, device=dev, dtype=torch.int32))
        torch.cuda.synchronize()
        counts.append({name: compiled_variants(kern) for name, kern in kernels.items()})
    assert all(c == counts[0] for c in counts[1:]), counts
