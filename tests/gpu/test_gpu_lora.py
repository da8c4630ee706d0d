"""LoRA adapters in the paged engine on a CUDA GPU (--enable-lora): the adapter compute against
PEFT's PeftModel on the same GPU (teacher-forced through prefill and graph-replayed decode, fp32
within 1e-5, bf16 within 2e-2), CUDA-graph replay against eager decode with an adapter (within
bf16 tolerance), graphs captured once that follow an adapter switch and the base model (the
base bit for bit an engine's without --enable-lora), and the scheduler running requests of
several adapters one adapter per forward as each group alone.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_engine import SEQ, TOL, assert_teacher_forced
from tests.gpu.test_gpu_engine import runner_for as engine_runner
from tests.helpers.lora_adapters import ALL_TARGETS, make_adapter
from tests.helpers.scheduling import generate_once

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def runner_for(model_dir, dtype, **kw):
    """test_gpu_engine's runner with --enable-lora (adapters up to rank 8) unless `kw` says
    otherwise."""
    return engine_runner(model_dir, dtype, **{"enable_lora": True, "max_lora_rank": 8, **kw})


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir):
    root = tiny_model_dir.parent
    return {"full": make_adapter(tiny_model_dir, root / "gpu-lora-full", r=4, alpha=8,
                                 targets=ALL_TARGETS, seed=1)[1],
            "qv": make_adapter(tiny_model_dir, root / "gpu-lora-qv", r=2, alpha=6,
                               targets=["q_proj", "v_proj"], seed=2)[1]}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_logprobs_match_peft_on_the_gpu(tiny_model_dir, adapter_dirs, dtype):
    peft_model, _ = make_adapter(tiny_model_dir, tiny_model_dir.parent / f"gpu-lora-{dtype}",
                                 r=4, alpha=8, targets=ALL_TARGETS, seed=1, device="cuda",
                                 dtype=DTYPES[dtype])
    with torch.no_grad():
        ref = torch.log_softmax(
            peft_model(input_ids=torch.tensor([SEQ]).cuda()).logits[0].float(), -1)
    del peft_model
    runner = runner_for(tiny_model_dir, dtype)
    assert runner.graphs
    runner.lora.load("full", adapter_dirs["full"])
    runner.use_lora("full")
    assert_teacher_forced(runner, ref, TOL[dtype])


def test_graph_replay_with_adapters_equals_eager(tiny_model_dir, adapter_dirs):
    """Graphs captured once: decode under the base model, one adapter, another and the first
    again, against eager decode (within bf16 tolerance); the base against an engine without
    --enable-lora bit for bit, before the adapters ran and, on new requests, after; and the
    adapters really change the logits."""
    graphed = runner_for(tiny_model_dir, "bf16")
    eager = runner_for(tiny_model_dir, "bf16", disable_cuda_graph=True)
    plain = runner_for(tiny_model_dir, "bf16", enable_lora=False)
    assert graphed.graphs and plain.graphs and not eager.graphs
    for r in (graphed, eager):
        for name, path in adapter_dirs.items():
            r.lora.load(name, path)
    prompts = {"a": SEQ[:5], "b": SEQ[3:14], "c": SEQ[:1]}
    for r in (graphed, eager, plain):
        r.prefill([(rid, p, 0) for rid, p in prompts.items()], want=[False] * 3)
    step = 0
    for adapter in (None, "full", "qv", "full"):
        graphed.use_lora(adapter)
        eager.use_lora(adapter)
        for _ in range(10):
            toks = [(step * 7 + i) % 30 for i in range(3)]
            a = graphed.decode(list(prompts), toks).float().clone()
            b = eager.decode(list(prompts), toks).float().clone()
            base = plain.decode(list(prompts), toks).float().clone()
            torch.testing.assert_close(a, b, atol=2e-2, rtol=1.6e-2)
            if adapter is None:
                assert torch.equal(a, base), step
            else:
                assert (a - base).abs().max() > 0.05, step
            step += 1
    graphed.use_lora(None)  # the base again, on requests whose KV is all its own
    fresh = {"d": SEQ[2:9], "e": SEQ[6:8]}
    for r in (graphed, plain):
        r.prefill([(rid, p, 0) for rid, p in fresh.items()], want=[False] * 2)
    for step in range(10):
        toks = [(step * 5 + i) % 30 for i in range(2)]
        assert torch.equal(graphed.decode(list(fresh), toks), plain.decode(list(fresh), toks))


def greedy(runner, prompts, loras, **options):
    """Greedy continuations (12 tokens) of `prompts` under adapters `loras`, all submitted at
    once to a scheduler over `runner` (overlapped decode, `options`); the finished requests."""
    return generate_once(runner, prompts, loras, new=12, max_prefill_tokens=256, **options)


def test_mixed_adapter_requests_match_each_adapter_alone(tiny_model_dir, adapter_dirs):
    """Requests of two adapters and the base submitted together (one adapter per forward, the
    adapters switching under overlapped multi-step decode with CUDA graphs) give each group's
    tokens of a fresh engine running that group alone."""
    prompts = [SEQ[i:2 * i + 5] for i in range(6)]
    loras = ["full", "qv", None, "full", None, "qv"]

    def engine():
        runner = runner_for(tiny_model_dir, "bf16")
        for name, path in adapter_dirs.items():
            runner.lora.load(name, path)
        return runner

    mixed = greedy(engine(), prompts, loras, num_continuous_decode_steps=4)
    assert all(r.finish_reason["type"] == "length" for r in mixed)
    for adapter in ("full", "qv", None):
        group = [i for i, lora in enumerate(loras) if lora == adapter]
        alone = greedy(engine(), [prompts[i] for i in group], [adapter] * len(group),
                       num_continuous_decode_steps=4)
        assert [mixed[i].output_ids for i in group] == [r.output_ids for r in alone], adapter
        for i, r in zip(group, alone):
            torch.testing.assert_close(torch.tensor(mixed[i].output_logprobs),
                                       torch.tensor(r.output_logprobs), atol=1e-3, rtol=0)
