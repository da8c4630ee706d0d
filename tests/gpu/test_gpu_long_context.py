"""The paged engine at 16k tokens per sequence on a CUDA GPU, Qwen2.5-0.5B's shapes (random-init):
a 16,368-token prompt prefilled in the CUDA default chunks of 8,192 (the second chunk attends to
the first through the pool), then 15 graph-replayed decode steps, teacher-forced, against
transformers (sdpa) in fp32 on the same GPU. fp32: within 5e-5 (attention sums over 16k keys
in another order than SDPA's; an H100 gave 2.2e-5, 2026-12-07). bf16: no further from the fp32
reference than BF16_SLACK times transformers' own bf16 forward is (24 layers of bf16 rounding at
16k positions put both ~0.1 off somewhere in 16 x 152k logprobs; a fixed bound would be
arbitrary). The rows of the reference differ from each other by more than twice the bound, so a
token attended at the wrong position cannot pass.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from rltool.engine.paged_runner import PagedRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP32_TOL = 5e-5
BF16_SLACK = 2.0
CONTEXT = 16384
DECODE = 16  # rows compared: the prefill's last, then DECODE - 1 decode steps
CHUNK = 8192  # --chunked-prefill-size's CUDA default


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_16k_tokens_match_transformers_on_the_gpu(dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    from rltool.data.models import init_model

    model_dir = init_model(tmp_path / "qwen2.5-0.5b", preset="qwen2.5-0.5b", dtype=dtype,
                           device="cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 150_000, (CONTEXT,), generator=g).tolist()

    def reference(torch_dtype: torch.dtype) -> torch.Tensor:
        """transformers' logprobs at positions CONTEXT - 1 - DECODE .. CONTEXT - 2."""
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype,
                                                  attn_implementation="sdpa").cuda().eval()
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids[:-1]]).cuda(), logits_to_keep=DECODE).logits[0]
        out = torch.log_softmax(logits.float(), -1).cpu()
        del hf, logits
        torch.cuda.empty_cache()
        return out

    ref = reference(torch.float32)
    tol = FP32_TOL if dtype == "fp32" else \
        BF16_SLACK * (reference(torch.bfloat16) - ref).abs().max().item()

    prompt = CONTEXT - DECODE
    runner = PagedRunner(model_dir, device="cuda", dtype=dtype, max_running=2, page_size=16,
                         max_total_tokens=CONTEXT + 32, cuda_graph_max_bs=2, prefix_cache=False)
    assert runner.context_length == 32768
    rows = []
    for start in range(0, prompt, CHUNK):
        end = min(start + CHUNK, prompt)
        got = runner.prefill([("a", ids[start:end], start)], want=[end == prompt])
    rows.append(got[0].float().clone())
    for t in range(prompt, CONTEXT - 1):
        # .clone(): the graph's output buffer is reused by the next step
        rows.append(runner.decode(["a"], [ids[t]])[0].float().clone())
    paged = torch.log_softmax(torch.stack(rows), -1).cpu()
    assert paged.shape == ref.shape
    runner.release()
    assert (paged - ref).abs().max() <= tol
    # A row off by one position would be caught: it would be over tol from the reference, as
    # neighbouring rows differ by more than twice tol.
    assert (ref[1:] - ref[:-1]).abs().amax(-1).min() > 2 * tol
