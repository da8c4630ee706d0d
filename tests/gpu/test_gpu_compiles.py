"""No compilation inside a serving run once the engine has warmed up: twenty arrival patterns
(benchmarks.engine_arrivals: 1 to 64 requests, prompts of 17 to 1500 tokens, with and without a
cached prefix, arriving in waves) through a bf16 engine on the GPU, per prefill attention.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks.engine_arrivals import arrival_patterns, run_pattern
from rltool.engine.compile_watch import CompileWatch
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """The `small` preset (context 2048) in bf16, drawn on the GPU."""
    from rltool.data.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "small", preset="small",
                      task="reverse", dtype="bf16", device="cuda")


def triton_variants() -> int:
    """Kernel variants Triton holds for every Triton kernel of rltool's loaded modules (an
    autotuned or heuristic kernel through the function it wraps)."""
    from triton.runtime.jit import JITFunction

    kernels = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("rltool") and module is not None:
            for value in vars(module).values():
                fn = value
                while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
                    fn = fn.fn
                if isinstance(fn, JITFunction):
                    kernels.add(fn)
    return sum(len(cache[0]) for fn in kernels for cache in fn.device_caches.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attention", ["varlen", "grouped"])
def test_twenty_arrival_patterns_compile_nothing_after_warmup(small_model, attention,
                                                              record_property):
    """The engine's reported `compiles_since_warmup` equals a watch of the test's own and the
    variants Triton's kernels gained: zero Triton compilations and dynamo graphs for either
    attention, and for varlen no new SDPA shape either (one flash call takes any segments); the
    grouped path's new SDPA shapes are reported (`record_property`), not asserted."""
    runner = PagedRunner(small_model, device="cuda", dtype="bf16", max_running=64,
                         cuda_graph_max_bs=64, max_total_tokens=200_000,
                         prefill_attention=attention)
    own = CompileWatch()  # created after the engine's warm-up: counts from here
    variants = triton_variants()
    sched = PagedScheduler(runner, max_running=64, max_prefill_tokens=16384,
                           chunked_prefill_size=8192)
    sched.start()
    try:
        for i, waves in enumerate(arrival_patterns(runner.vocab_size, seed=1)):
            run_pattern(sched, waves, tag=f"{attention}{i}", new_tokens=4, timeout_s=60)
        reported = sched.stats()["compiles_since_warmup"]
    finally:
        sched.stop()
        runner.release()
    record_property("compiles_since_warmup", reported)
    print(attention, reported)
    assert reported["triton"] == own.since_warmup()["triton"] == triton_variants() - variants
    assert reported["triton"] == 0 and reported["dynamo"] == 0, reported
    if attention == "varlen":
        assert reported["total"] == 0, reported


def test_decode_attention_compiles_once_for_any_number_of_splits():
    """Batches of 1 to 64 decode rows (as a prefill's continuation tokens or an eager decode
    step have them) take as many splits as `num_splits_for` gives: the two stages compile once."""
    from rltool.engine.decode_attention import _stage1, _stage2, decode_attention, num_splits_for
    from tests.helpers.engines import filled_page_table

    heads, kvh, d, page = 4, 2, 64, 16
    table = filled_page_table(64, 100, num_pages=512, page_size=page, device="cuda")
    k_cache, v_cache = (torch.randn(512 * page, kvh, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    counts, splits = [], set()
    for t in (1, 3, 5, 9, 17, 33, 64):
        splits.add(num_splits_for(t, kvh))
        rows = torch.tensor([table.entries[f"r{i}"].row for i in range(t)], device="cuda")
        decode_attention(torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16), k_cache,
                         v_cache, req_to_page=table.req_to_page, rows=rows,
                         seq_lens=torch.full((t,), 100, device="cuda"), page_size=page,
                         scale=d ** -0.5, num_splits=num_splits_for(t, kvh))
        torch.cuda.synchronize()
        counts.append([sum(len(c[0]) for c in k.device_caches.values())
                       for k in (_stage1, _stage2)])
    assert len(splits) > 3, splits
    assert all(c == counts[0] for c in counts), counts
