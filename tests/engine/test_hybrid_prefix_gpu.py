"""The hybrid prefix cache (rltool.engine.hybrid_prefix) on a CUDA GPU, through the GDN Triton
kernels: two GRPO groups of 8 greedy samples, prompts of 480 tokens (a snapshot one token before
the end, inside the last page) and 470 (at the end of the last full page, 464), against the same
requests on an engine without the prefix cache: the same tokens, logprobs within 1e-4 in fp32,
prefill tokens within 1.15x of the unique prompt tokens, every state slot accounted for after.

Skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from rltool.engine.hybrid_prefix import snapshot_point
from rltool.engine.paged_runner import PagedRunner
from tests.engine.test_hybrid_prefix import assert_idle, prompt_of, serve
from tests.engine.test_hybrid import greedy
from tests.helpers.hybrid import make_hybrid

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PS = 16


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grpo_groups_reuse_their_snapshots_on_the_gpu(dtype, tmp_path):
    model = make_hybrid(tmp_path / "m", task=None)
    lengths = (480, 470)  # + 16 new tokens within the tiny model's 512 positions
    prompts = [prompt_of(n, seed=i) for i, n in enumerate(lengths)]
    runs = {}
    for cache in (True, False):
        runner = PagedRunner(model, device="cuda", dtype=dtype, max_running=16, page_size=PS,
                             max_total_tokens=16384, prefix_cache=cache)
        reqs = [greedy(f"g{p}-{i}", prompt, n=16) for p, prompt in enumerate(prompts)
                for i in range(8)]
        sched = serve(runner, [reqs], max_prefill_tokens=8192)
        runs[cache] = (reqs, sched.num_prefill_tokens)
        if cache:
            assert_idle(runner)
        runner.release()
    (cached, computed), (fresh, _) = runs[True], runs[False]
    unique = sum(lengths)
    tails = [n - snapshot_point(n, PS) for n in lengths]  # 1 and 6 tokens per later sample
    assert computed == unique + 7 * sum(tails)
    assert computed <= 1.15 * unique
    assert sorted(r.cached_tokens for r in cached) == sorted(
        [0, 0] + [snapshot_point(n, PS) for n in lengths for _ in range(7)])
    if dtype == "fp32":
        for got, want in zip(cached, fresh):
            assert got.output_ids == want.output_ids, got.rid
            assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)
