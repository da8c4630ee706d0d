"""`--backend megatron` on one CUDA GPU: fp32 against the torch backend on the same GPU, and bf16
with the distributed optimizer (megatron's bf16 optimizers run on CUDA only; the fp32 distributed
optimizer's resume is also checked on the CPU, tests/train/test_megatron.py).

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none).
Tolerance 1e-4 (1e-5 on the CPU): the two backends' attention runs different CUDA SDPA kernels
(packed per-sample calls against one padded, masked call).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rltool.train import run
from rltool.train.config import TrainConfig
from tests.helpers.shards import REWARDS, make_shard, shard_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARGS = dict(lr=3e-3, max_tokens_per_microbatch=24, global_batch_size=12, num_steps=1,
            entropy_coef=0.01)


@pytest.fixture(scope="module")
def shard(tiny_model_dir, tmp_path_factory):
    return make_shard(tmp_path_factory.mktemp("gpu-megatron") / "rollouts" / "step-000001",
                      tiny_model_dir, shard_rows(REWARDS), temperature=0.8)



@pytest.fixture
def backend_group():
    """A test that builds a MegatronBackend itself starts the process group with it; the group
    (and megatron's model-parallel state) ends with the test, as `rltool train` ends it."""
    from rltool.train.launch import process_group_scope

    with process_group_scope():
        yield

def test_megatron_fp32_on_cuda_matches_torch(tiny_model_dir, shard, tmp_path):
    out = {}
    for backend in ("torch", "megatron"):
        result = run(TrainConfig(rollouts=[str(shard)], load=str(tiny_model_dir),
                                 save=str(tmp_path / backend), backend=backend, **ARGS))
        step = tmp_path / backend / "step-000001"
        out[backend] = (result.metrics[0], load_file(step / "data.safetensors")["old_logprobs"],
                        load_file(step / "model" / "model.safetensors"))
    (m_ref, lp_ref, w_ref), (m, lp, w) = out["torch"], out["megatron"]
    assert torch.allclose(lp, lp_ref, rtol=0, atol=1e-4)
    for name in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert m[name] == pytest.approx(m_ref[name], rel=0, abs=1e-4), name
    assert w.keys() == w_ref.keys()
    for name in w_ref:
        assert torch.allclose(w[name], w_ref[name], rtol=0, atol=1e-4), name


def test_megatron_bf16_distributed_optimizer_trains_and_resumes(tiny_model_dir, shard, tmp_path):
    cfg = dict(ARGS, num_steps=2, rollouts=[str(shard)], backend="megatron", dtype="bf16",
               use_distributed_optimizer=True)
    straight = run(TrainConfig(load=str(tiny_model_dir), save=str(tmp_path / "a"),
                               save_interval=1, **cfg))
    assert all(math.isfinite(row["train/loss"]) for row in straight.metrics)
    state = json.loads((tmp_path / "a" / "step-000001" / "trainer_state.json").read_text())
    assert state["backend"]["use_distributed_optimizer"] is True
    resumed = run(TrainConfig(load=str(tmp_path / "a" / "step-000001"), save=str(tmp_path / "b"),
                              **cfg))
    # the resumed step 2 is the straight one bit for bit: same Adam moments, master weights and
    # step count (bias correction) per parameter
    for name in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert resumed.metrics[0][name] == straight.metrics[1][name], name
    a = load_file(tmp_path / "a" / "step-000002" / "model" / "model.safetensors")
    b = load_file(tmp_path / "b" / "step-000002" / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_weight_gradients_accumulate_into_fp32_main_grads_in_the_gemm(tiny_model_dir, backend_group):
    """Without apex, the CUDA stand-in of its fused weight-gradient GEMM is switched on for the
    bf16 trainer and adds grad_output^T @ input to the fp32 buffer with fp32 accumulation."""
    from megatron.core.tensor_parallel import layers

    from rltool.train.config import BackendConfig
    from rltool.train.megatron_backend import MegatronBackend

    backend = MegatronBackend(tiny_model_dir, options=BackendConfig(
        backend="megatron", dtype="bf16", device="cuda", lr=1e-3))
    assert backend.config.gradient_accumulation_fusion
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(512, n, device="cuda", generator=g).bfloat16() for n in (64, 96))
    acc = torch.randn(96, 64, device="cuda", generator=g)
    want = acc.double() + dy.t().double() @ x.double()
    layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, acc)
    assert (acc.double() - want).abs().max().item() < 1e-4


def test_megatron_bf16_micro_batch_never_waits_for_the_gpu(tiny_model_dir, backend_group):
    """Packing, the forward (RoPE reads host offsets, one varlen flash call), the chunked logprobs
    and the backward of a packed bf16 micro-batch make no host-device synchronisation."""
    from rltool.train.backend import ForwardOutput, MicroBatch
    from rltool.train.config import BackendConfig
    from rltool.train.megatron_backend import MegatronBackend

    backend = MegatronBackend(tiny_model_dir, options=BackendConfig(
        backend="megatron", dtype="bf16", device="cuda", lr=1e-3))
    unit = MicroBatch([0, 1], [[5, 6, 7, 8, 9], [4, 3, 2]], [2, 1])

    def micro_batch() -> ForwardOutput:
        p, params = backend._pack(unit, 10)
        with backend._hidden_out():
            hidden = backend.model(p.ids, p.position_ids, None, packed_seq_params=params)
        out = backend._outputs(hidden, p, samples=len(unit.tokens), temperature=1.0,
                               with_entropy=True, top_k=0)
        sum(lp.sum() for lp in out.logprobs).backward()
        return out

    micro_batch()  # first use: lazy initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = micro_batch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t.shape[0] for t in out.logprobs] == [3, 2]


def test_megatron_bf16_train_step_waits_for_the_gpu_per_step_not_per_micro_batch(tiny_model_dir, backend_group):
    """A whole bf16 train_step through megatron's schedule, loss, gradient reduction and optimizer
    makes as many host-device synchronisations with 4 micro-batches as with 1 (the per-step
    reads: the grad norm, the summed metrics), so none happens per micro-batch."""
    import warnings
    from collections import Counter

    from rltool.train.backend import MicroBatch
    from rltool.train.config import BackendConfig
    from rltool.train.megatron_backend import MegatronBackend

    backend = MegatronBackend(tiny_model_dir, options=BackendConfig(
        backend="megatron", dtype="bf16", device="cuda", lr=1e-3))

    def loss_fn(out, mb):
        loss = -sum(lp.sum() for lp in out.logprobs) / 100
        return loss, {"train/loss": loss.detach()}

    def syncs(count: int) -> Counter:
        """Where the train step of `count` micro-batches synchronised: file:line -> times."""
        mbs = [MicroBatch([i], [[5, 6, 7, 8, 9, 4 + i]], [2]) for i in range(count)]
        backend.train_step(mbs, loss_fn, temperature=1.0)  # first use of these shapes
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                backend.train_step(mbs, loss_fn, temperature=1.0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return Counter(f"{w.filename}:{w.lineno}" for w in caught
                       if "synchronizing" in str(w.message))

    one, four = syncs(1), syncs(4)
    assert four == one, f"per micro-batch: {four - one}"


@pytest.mark.parametrize("deterministic", [False, True])
def test_megatron_bf16_logprob_pass_waits_for_the_gpu_per_call_not_per_sample(
        tiny_model_dir, deterministic, backend_group):
    """forward_logprobs (entropy and top-k too) makes as many host-device synchronisations for 4
    samples as for 1: its outputs reach the host in one copy per field after the schedule (with
    --deterministic every sample is its own micro-batch)."""
    import warnings
    from collections import Counter

    from rltool.train.backend import MicroBatch
    from rltool.train.config import BackendConfig
    from rltool.train.megatron_backend import MegatronBackend

    backend = MegatronBackend(tiny_model_dir, trainable=False, options=BackendConfig(
        backend="megatron", dtype="bf16", device="cuda", deterministic=deterministic))

    def syncs(count: int) -> Counter:
        batch = MicroBatch(list(range(count)), [[5, 6, 7, 8, 9, 4 + i] for i in range(count)],
                           [2] * count)

        def run():
            return backend.forward_logprobs(batch, temperature=1.0, with_entropy=True, top_k=2)

        first = run()  # first use of these shapes
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert all(torch.equal(a, b) for a, b in zip(first.logprobs, out.logprobs))
        assert len(out.logprobs) == len(out.topk_ids) == count
        return Counter(f"{w.filename}:{w.lineno}" for w in caught
                       if "synchronizing" in str(w.message))

    one, four = syncs(1), syncs(4)
    assert four == one, f"per sample: {four - one}"
