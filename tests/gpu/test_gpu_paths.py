"""CUDA paths: the torch trainer (fp32, bf16) and its logprob layout on the GPU, the CPU-only builtin
engine against the CUDA trainer, and the megatron-core GPTModel on CUDA against transformers.

Every test here needs a CUDA GPU: each skips only when `torch.cuda.is_available()` is false (the
CI machines have none). References are float64 CPU computations or the transformers model itself.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from rltool.data.shards import open_shard
from rltool.logprobs import sequence_logprobs
from rltool.train import run
from rltool.train.config import TrainConfig
from rltool.train.stage import recompute_logprobs
from tests.helpers.shards import REWARDS, make_shard, shard_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMMON = dict(lr=3e-3, max_tokens_per_microbatch=40, global_batch_size=6)


@pytest.fixture(scope="module")
def shard(tiny_model_dir, tmp_path_factory):
    """12 samples in 3 groups of 4, sampled at temperature 0.8 (as tests/train's train_shard)."""
    return make_shard(tmp_path_factory.mktemp("gpu") / "rollouts" / "step-000001",
                      tiny_model_dir, shard_rows(REWARDS), temperature=0.8)


def _hf_model(model_dir, *, device: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


def _float64_reference(model_dir, rows, *, temperature: float) -> list[torch.Tensor]:
    """Response logprobs of every row from a float64 copy of the model on the CPU."""
    model = _hf_model(model_dir, device="cpu", dtype=torch.float64)
    out = []
    with torch.no_grad():
        for row in rows:
            ids = row["prompt_token_ids"] + row["response_token_ids"]
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            start = len(row["prompt_token_ids"])
            lp = []
            for t in range(start, len(ids)):  # plain loop: log softmax of row t-1 at token t
                scaled = logits[t - 1] / temperature
                lp.append(float(scaled[ids[t]] - torch.logsumexp(scaled, dim=0)))
            out.append(torch.tensor(lp, dtype=torch.float64))
    return out


def test_trainer_backend_runs_on_cuda(tiny_model_dir):
    from rltool.train.config import BackendConfig
    from rltool.train.torch_backend import TorchBackend

    backend = TorchBackend(tiny_model_dir, options=BackendConfig())
    assert backend.device.type == "cuda"
    assert all(p.is_cuda for p in backend.inner.parameters())


def test_deterministic_layout_on_cuda_is_exact(tiny_model_dir, shard):
    """The trainer's deterministic recompute on CUDA equals rltool.logprobs.sequence_logprobs on
    the same CUDA model with the batch-invariant kernels bit for bit; padded micro-batches and a
    float64 CPU reference agree to 1e-4 (no TF32: torch leaves it off for fp32 matmuls)."""
    from rltool import batch_invariant

    assert not torch.backends.cuda.matmul.allow_tf32
    rows = open_shard(shard).rows()
    exact = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=40,
                               deterministic=True)
    padded = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=40,
                                deterministic=False)
    model = _hf_model(tiny_model_dir, device="cuda")
    reference = _float64_reference(tiny_model_dir, rows, temperature=0.8)
    for row, got, pad, ref in zip(rows, exact, padded, reference, strict=True):
        with batch_invariant.enabled("cuda"):
            want = sequence_logprobs(model, row["prompt_token_ids"] + row["response_token_ids"],
                                     response_start=len(row["prompt_token_ids"]),
                                     temperature=0.8)
        assert want.is_cuda
        assert torch.equal(torch.tensor(got), want.cpu())  # bit for bit
        assert pad == pytest.approx(got, abs=1e-4)
        assert got == pytest.approx(ref.tolist(), abs=1e-4)


def test_bf16_recompute_on_cuda_matches_autocast_layout(tiny_model_dir, shard):
    """bf16 recompute: padded, fp32 master weights under CUDA bf16 autocast, equal to
    sequence_logprobs under the same autocast to bf16 rounding; deterministic, the frozen model
    holds bf16 weights (the engine's bf16 layout) and runs the batch-invariant kernels: equal to
    sequence_logprobs on a bf16 model with those kernels bit for bit. Both near float64."""
    from rltool import batch_invariant

    rows = open_shard(shard).rows()
    got_all = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=40,
                                 deterministic=True, dtype="bf16")
    padded = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=40,
                                deterministic=False, dtype="bf16")
    model = _hf_model(tiny_model_dir, device="cuda", dtype=torch.bfloat16)
    reference = _float64_reference(tiny_model_dir, rows, temperature=0.8)
    worst = 0.0
    for row, got, pad, ref in zip(rows, got_all, padded, reference, strict=True):
        with batch_invariant.enabled("cuda"):
            want = sequence_logprobs(model, row["prompt_token_ids"] + row["response_token_ids"],
                                     response_start=len(row["prompt_token_ids"]), temperature=0.8)
        assert torch.equal(torch.tensor(got), want.cpu())
        assert pad == pytest.approx(got, abs=0.1)
        worst = max(worst, float((torch.tensor(got, dtype=torch.float64) - ref).abs().max()))
    assert 0.0 < worst < 0.1  # bf16 rounding shows, but stays small on a tiny model


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grpo_steps_on_cuda(tiny_model_dir, shard, tmp_path, dtype):
    """Two GRPO optimizer steps per epoch, two epochs on CUDA: every sample with a non-zero
    advantage moves its logprob in the advantage's direction; the published weights are a HF
    checkpoint in the training dtype with fp32 master weights saved."""
    before = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=40,
                                deterministic=True)
    result = run(TrainConfig(rollouts=[str(shard)], load=str(tiny_model_dir), dtype=dtype,
                             save=str(tmp_path / "ckpt"), publish=str(tmp_path / "weights"),
                             num_epochs=2, **COMMON))
    assert result.optimizer_steps == 4 and result.policy_version == 4
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in result.metrics)
    published = load_file(tmp_path / "weights" / "weight_v000004" / "model.safetensors")
    master = load_file(tmp_path / "ckpt" / "step-000004" / "model" / "model.safetensors")
    want_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert {t.dtype for t in published.values()} == {want_dtype}
    assert {t.dtype for t in master.values()} == {torch.float32}
    after = recompute_logprobs(result.published, [shard], max_tokens_per_microbatch=40,
                               deterministic=True)
    rows = open_shard(shard).rows()
    moved = expected = 0
    for row, b, a in zip(rows, before, after, strict=True):
        group = REWARDS[row["group_id"]]
        advantage = row["reward"] - sum(group) / len(group)
        if advantage == 0:
            continue
        expected += 1
        delta = sum((y - x) * m for x, y, m in zip(b, a, row["loss_mask"]))
        moved += (delta > 0) == (advantage > 0)
    assert expected > 0 and moved == expected


# -- the builtin engine on a CUDA host ---------------------------------------------------------

@pytest.fixture(scope="module")
def det_engine(tiny_model_dir, tmp_path_factory):
    from rltool.rollout.launch import start_engine

    log_path = tmp_path_factory.mktemp("engine-logs") / "gpu-det.log"
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir), "--device", "cpu",
                         "--deterministic"],
                        log_path=log_path, ready_timeout_s=120.0)
    yield proc
    proc.stop()


def test_builtin_engine_on_cuda_host_matches_cuda_trainer(det_engine, tiny_model_dir):
    """The builtin engine told to serve from the CPU on a GPU machine (`--device cpu`).
    Its deterministic logprobs then match the CUDA trainer's layout to 1e-4, not bit for bit
    (different devices run different kernels), and match its own CPU layout exactly."""
    from rltool.rollout.client import EngineClient

    probe = {"input_ids": [5, 9, 13, 2, 30], "return_logprob": True, "rid": "gpu-probe",
             "sampling_params": {"max_new_tokens": 16, "temperature": 0.9, "sampling_seed": 7,
                                 "ignore_eos": True}}

    async def go():
        async with EngineClient(det_engine.url, timeout_s=120) as c:
            return await c.generate(probe)

    out = asyncio.run(go())
    engine_lp = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    ids = probe["input_ids"] + out["output_ids"]
    kw = dict(response_start=len(probe["input_ids"]), temperature=0.9)
    on_cpu = sequence_logprobs(_hf_model(tiny_model_dir, device="cpu"), ids, **kw)
    on_cuda = sequence_logprobs(_hf_model(tiny_model_dir, device="cuda"), ids, **kw)
    assert on_cpu.tolist() == engine_lp  # the engine is the CPU layout, exactly
    assert on_cuda.cpu().tolist() == pytest.approx(engine_lp, abs=1e-4)


# -- megatron-core GPTModel on CUDA ------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_megatron_gpt_model_on_cuda_matches_transformers(arch, tiny_model_factory, tmp_path):
    """HF -> torch_dist -> megatron-core GPTModel (local spec) on CUDA: logits equal the CUDA
    transformers model's within 1e-4 (fp32)."""
    from rltool import megatron_compat
    from rltool.convert.gpt_model import build_gpt_model
    from rltool.convert.torch_dist import HfToDistConfig, hf_to_dist, load_model_weights

    hf_dir = tiny_model_factory(arch)
    config = json.loads((hf_dir / "config.json").read_text())
    hf_to_dist(HfToDistConfig(hf=hf_dir, out=tmp_path / "dist"))
    ids = torch.randint(0, config["vocab_size"], (2, 9),
                        generator=torch.Generator().manual_seed(1)).cuda()
    pos = torch.arange(ids.shape[1], device="cuda")[None].expand_as(ids)
    with megatron_compat.distributed():
        model = build_gpt_model(config, perform_initialization=False)
        load_model_weights(model, tmp_path / "dist")
        model = model.cuda().eval()
        with torch.no_grad():
            got = model(ids, pos, None)[..., : config["vocab_size"]]
    assert got.is_cuda
    with torch.no_grad():
        want = _hf_model(hf_dir, device="cuda")(ids).logits
    assert (got - want).abs().max().item() < 1e-4


def test_trainer_can_stay_on_the_cpu_to_match_a_cpu_engine(tiny_model_dir, shard):
    """The builtin engine runs on the CPU; the align gate recomputes there (--device cpu, its
    default) so exact alignment holds on GPU hosts too."""
    rows = open_shard(shard).rows()
    on_cpu = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=64,
                                deterministic=True, device="cpu")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for row, lps in zip(rows, on_cpu):
        ids = list(row["prompt_token_ids"]) + list(row["response_token_ids"])
        ref = sequence_logprobs(model, ids, response_start=len(row["prompt_token_ids"]),
                                temperature=0.8)  # the shard's sampling temperature
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), ref)
