"""FP8 rollout on a CUDA GPU: the block-FP8 GEMMs (Triton and torch._scaled_mm) at Qwen2.5-0.5B's
shapes within the analytic bound of the float32 product; the quantization fused into RMSNorm and
SiLU-and-multiply bit-equal to the separate kernel at Qwen2.5-7B's sizes, and o_proj's into the
decode attention kernel (also through a served FP8 model's CUDA-graph decode: the same logits as
with the separate kernel); a block-FP8 checkpoint served with its linears kept in FP8 against the
bf16 model it came from; the FP8 KV cache through CUDA-graph decode against the bf16 cache.

Every test skips when `torch.cuda.is_available()` is false; the native GEMM's also where torch has
no 1x128 block scaling."""

from __future__ import annotations

import pytest
import torch

from rltool.convert.fp8 import Fp8Config, quantize_blocks_torch, quantize_checkpoint
from rltool.engine.paged_runner import PagedRunner
from tests.engine.test_fp8_kv import KV_TOL, paged_logprobs
from tests.helpers.fp8_gemm import error_bound, fp8_linear_float64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19, 25, 6, 13, 1, 28, 12, 15, 20]
# Measured on CPU (fp32, Triton's interpreter) for the tiny models: 0.029-0.039 nats between the
# FP8-resident model and the unquantized one; bf16 adds up to 0.02 (tests/gpu/test_gpu_engine.py).
FP8_WEIGHT_TOL = 0.15


@pytest.mark.parametrize("backend", ["triton", "native"])
@pytest.mark.parametrize("m", [1, 5, 64, 256, 2048])
def test_fp8_gemm_at_qwen_0_5b_shapes(m, backend):
    """qkv (with its bias), o, gate_up and down of Qwen2.5-0.5B, bf16 activations, both GEMMs:
    the float32 product within the analytic bound derived from the block scales
    (tests/helpers/fp8_gemm.py), which the same math with a wrong K-block's scales violates.
    `native` runs where torch._scaled_mm takes 1x128 block scales (Hopper, cuBLASLt >= 12.9)."""
    from rltool.engine import fp8_gemm

    if backend == "native" and not fp8_gemm.probe_native(torch.device("cuda")):
        pytest.skip("torch._scaled_mm has no 1x128 block scaling on this GPU")
    fp8_gemm.set_backend(backend)
    try:
        torch.manual_seed(m)
        caught = []  # per shape: outputs outside the bound with the wrong block's scales
        for n, k in [(1152, 896), (896, 896), (9728, 896), (896, 4864)]:
            # K-blocks of magnitudes 1 and 1/64: a scale taken from the wrong block shows
            w = (torch.randn(n, k, device="cuda") * 0.02
                 * 64.0 ** -(torch.arange(k, device="cuda") // 128 % 2).float())
            q, block_scale = quantize_blocks_torch(w, (128, 128))
            scale = block_scale.to("cuda").repeat_interleave(128, dim=0)[:n]
            kb_major = scale.t().contiguous().t()  # as the engine keeps it: strides (1, N)
            x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
            bias = torch.randn(n, device="cuda").to(torch.bfloat16) if n == 1152 else None
            got = fp8_gemm.fp8_linear(x, q, kb_major, block_k=128, bias=bias).double()
            exact, bound = error_bound(x, w, scale, 128, torch.bfloat16)
            if bias is not None:
                exact += bias.double()
                bound += torch.finfo(torch.bfloat16).eps * bias.double().abs()
            used = ((got - exact).abs() / bound).max().item()
            print(f"{backend} m={m} n={n} k={k}: max |err| / bound = {used:.3g}")
            assert used <= 1, (n, k)
            wrong = fp8_linear_float64(x, q, scale.roll(1, dims=1), 128)
            caught.append(((wrong + (0 if bias is None else bias.double()) - exact).abs()
                           > bound).sum().item())
        # the K=896 shapes; at K=4864 the bound (linear in K) leaves only a few outputs outside
        assert all(caught[:3]), caught
    finally:
        fp8_gemm.set_backend("auto")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_fp8_checkpoint_served_on_cuda_is_close_to_bf16(arch, tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory(arch, 0)
    quantize_checkpoint(Fp8Config(hf=model_dir, out=tmp_path / "fp8", block=(32, 32),
                                  workers=1))
    runners = [PagedRunner(d, device="cuda", dtype="bf16", max_running=8, page_size=4,
                           max_total_tokens=4096, cuda_graph_max_bs=8)
               for d in (model_dir, tmp_path / "fp8")]
    assert runners[1].weight_info["weight_dtype"] == "fp8_e4m3"
    assert runners[1].weight_info["quantization"]["resident"] == "fp8"
    assert runners[1].model.nbytes() < runners[0].model.nbytes()
    outs = []
    for r in runners:
        rows = [r.full_pass_logits(SEQ, start=1)[-1:].float()]
        rows.append(r.prefill([("a", SEQ[:12], 0)], want=[True]).float())
        for t in range(12, len(SEQ)):  # graph-replayed decode steps
            rows.append(r.decode(["a"], [SEQ[t]]).float())
        outs.append(torch.log_softmax(torch.cat(rows), -1))
    diff = (outs[0] - outs[1]).abs().max().item()
    print(f"{arch}: max |logprob(fp8 weights) - logprob(bf16)| = {diff:.4f}")
    assert 0 < diff < FP8_WEIGHT_TOL


def test_fp8_kv_decode_on_cuda(tiny_model_factory):
    """The FP8 KV cache through the fused cache write, the Triton decode kernel and CUDA-graph
    replay: within the CPU test's tolerance of the bf16 cache."""
    model_dir = tiny_model_factory("qwen2", 0)
    ref = paged_logprobs(model_dir, "bf16", "auto", device="cuda")
    got = paged_logprobs(model_dir, "bf16", "fp8_e4m3", device="cuda")
    diff = (got - ref).abs().max().item()
    print(f"max |logprob(fp8 KV) - logprob(bf16 KV)| = {diff:.4f}")
    assert 0 < diff < KV_TOL


@pytest.mark.parametrize("m", [1, 5, 64, 256])
def test_quantization_fused_into_norm_and_silu_on_cuda(m):
    """At Qwen2.5-7B's hidden and intermediate sizes, compiled: RMSNorm (with the residual add)
    and SiLU-and-multiply writing their output quantized give the bytes and scales of the
    unfused kernels followed by the quantization kernel, and the FP8 GEMM (as served: native
    where its probe passes) the same result from either."""
    from rltool.engine import fp8_gemm, fused

    torch.manual_seed(m)
    hidden, inter = 3584, 18944
    x, res = (torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2))
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    pairs = [(fused.add_rms_norm(x, res.clone(), w, 1e-6, 128)[0],
              fused.add_rms_norm(x, res.clone(), w, 1e-6)[0]),
             (fused.silu_mul(gu, 128), fused.silu_mul(gu))]
    for got, plain in pairs:
        want = fp8_gemm.activations(plain, 128)
        assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
        assert torch.equal(got.s, want.s)
        q, block_scale = quantize_blocks_torch(
            torch.randn(512, plain.shape[1], device="cuda") * 0.02, (128, 128))
        scale = block_scale.to("cuda").repeat_interleave(128, dim=0).t().contiguous().t()
        assert torch.equal(fp8_gemm.fp8_linear(got, q, scale, block_k=128),
                           fp8_gemm.fp8_linear(plain, q, scale, block_k=128))


@pytest.mark.parametrize("m", [1, 5, 64, 256])
def test_o_proj_quantization_fused_into_decode_attention_on_cuda(m):
    """At Qwen2.5-7B's attention shapes (28 heads of 128 over 4 KV heads), compiled, bf16 and FP8
    caches: decode attention writing o_proj's input quantized gives the bytes and scales of the
    bf16 output followed by the quantization kernel, and the FP8 GEMM (as served) the same
    result; head_dim 64 (a K-block spanning two heads) falls back to the bf16 output."""
    from rltool.engine import fp8_gemm
    from rltool.engine.decode_attention import decode_attention, num_splits_for
    from rltool.engine.paged import PageTable

    torch.manual_seed(m)
    page = 16
    table = PageTable(num_pages=64 * m + 8, page_size=page, max_requests=m,
                      max_pages_per_request=64, device="cuda")
    lens = torch.randint(1, 1000, (m,)).tolist()
    for i, n in enumerate(lens):
        table.add(f"r{i}")
        table.extend(f"r{i}", n)
    table.flush()
    slots = (64 * m + 8) * page
    kw = dict(req_to_page=table.req_to_page, page_size=page,
              rows=torch.tensor([table.entries[f"r{i}"].row for i in range(m)], device="cuda"),
              seq_lens=torch.tensor(lens, device="cuda"), num_splits=num_splits_for(m, 4))
    for head_dim, cache in [(128, "bf16"), (128, "fp8"), (64, "bf16")]:
        k, v = (torch.randn(slots, 4, head_dim, device="cuda") * 2 for _ in range(2))
        scales = {}
        if cache == "fp8":
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            scales = {"k_scale": torch.rand(slots, 4, device="cuda") + 0.01,
                      "v_scale": torch.rand(slots, 4, device="cuda") + 0.01}
        else:
            k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        q = torch.randn(m, 28, head_dim, device="cuda", dtype=torch.bfloat16)
        args = dict(kw, scale=head_dim ** -0.5, **scales)
        plain = decode_attention(q, k, v, **args)
        got = decode_attention(q, k, v, block_k=128, **args)
        if head_dim != 128:
            assert torch.equal(got, plain)
            continue
        want = fp8_gemm.activations(plain.reshape(m, -1), 128)
        assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
        assert torch.equal(got.s, want.s)
        qw, block_scale = quantize_blocks_torch(
            torch.randn(3584, 28 * head_dim, device="cuda") * 0.02, (128, 128))
        scale = block_scale.to("cuda").repeat_interleave(128, dim=0).t().contiguous().t()
        assert torch.equal(fp8_gemm.fp8_linear(got, qw, scale, block_k=128),
                           fp8_gemm.fp8_linear(plain.reshape(m, -1), qw, scale, block_k=128))


def test_fp8_engine_decode_unchanged_by_fused_o_proj_quantization(tmp_path, monkeypatch):
    """A block-FP8 checkpoint (head_dim 32, 32x32 blocks: one K-block per head) served on CUDA:
    greedy CUDA-graph decode of a batch gives the same tokens and bit-equal logits whether
    decode attention writes o_proj's input quantized or, forced to its fallback, the separate
    kernel quantizes it."""
    from rltool.data.models import init_model
    from rltool.engine import decode_attention as attention
    from rltool.engine.quant import Fp8Weight

    model_dir = init_model(tmp_path / "small", arch="qwen2", preset="small", task="reverse")
    quantize_checkpoint(Fp8Config(hf=model_dir, out=tmp_path / "fp8", block=(32, 32),
                                  workers=1))
    kinds = []
    plain_call = attention.decode_attention

    def spy(*args, **kw):
        out = plain_call(*args, **kw)
        kinds.append(type(out).__name__)
        return out

    monkeypatch.setattr(attention, "decode_attention", spy)
    prompts = [SEQ[:12], SEQ[3:10], SEQ[5:20]]
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(attention, "quantizes", lambda head_dim, block_k: False)
        kinds.clear()
        r = PagedRunner(tmp_path / "fp8", device="cuda", dtype="bf16", max_running=4,
                        page_size=4, max_total_tokens=4096, cuda_graph_max_bs=4)
        assert r.graphs and isinstance(r.model.layers[0]["o"], Fp8Weight)
        rids = [f"r{i}" for i in range(len(prompts))]
        logits = r.prefill([(rid, p, 0) for rid, p in zip(rids, prompts)],
                           want=[True] * len(prompts))
        tokens, rows = [logits.argmax(-1)], []
        for _ in range(16):
            out = r.decode(rids, tokens[-1].tolist()).float().clone()
            rows.append(out)
            tokens.append(out.argmax(-1))
        # the capture and the warm-up's decode step; the warm-up's short continuation chunk (a
        # prefill's decode rows: no o_proj input to write) returns a tensor either way
        assert ("Fp8Activations" in kinds) == fused and "Tensor" in kinds, kinds
        runs.append((torch.stack(tokens), torch.stack(rows)))
        del r
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
