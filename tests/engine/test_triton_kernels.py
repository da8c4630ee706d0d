"""The Triton kernels against their torch references: compiled on a CUDA machine, elsewhere run by
Triton's interpreter on CPU, each test in a child process started with TRITON_INTERPRET=1.
Split-KV decode attention (pages scattered out of order, lengths ending mid-page and mid-block, a one-token sequence, GQA groups, several
split counts; its output quantized for an FP8 o_proj), the fused norm / RoPE + KV write / SiLU
kernels, and the whole model with them."""

from __future__ import annotations

import pytest
import torch

from rltool.engine.paged import PageTable, decode_attention_ref
from tests.helpers import triton_child
from tests.helpers.engines import generate_deterministic
from tests.helpers.triton_child import ran_in_child

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CHILD = "RLTOOL_TRITON_INTERPRET_CHILD"


@pytest.fixture(scope="module")
def child_report(tmp_path_factory) -> dict[str, str] | None:
    """Without CUDA: this module's tests run once more in a child process started with
    TRITON_INTERPRET=1; {test name: failure text, "" when it passed}. Triton decides interpreted
    or compiled when triton.language is first imported, for the whole process, and other tests
    import it first; mixing the two breaks both. On CUDA, or in the child: None."""
    return triton_child.child_report(__file__, CHILD, tmp_path_factory.mktemp("triton-child"), 900)


@pytest.fixture
def on_dev():
    """New tensors on the kernels' device while the test runs."""
    torch.set_default_device(DEV)
    yield
    torch.set_default_device("cpu")


def test_kernel_matches_reference(on_dev, request):
    if ran_in_child(request):
        return
    for heads, kv_heads, head_dim, page_size in [(4, 2, 16, 4), (14, 2, 64, 16), (8, 8, 32, 1)]:
        check_decode_kernel(heads, kv_heads, head_dim, page_size)


def check_decode_kernel(heads: int, kv_heads: int, head_dim: int, page_size: int) -> None:
    from rltool.engine.decode_attention import decode_attention

    torch.manual_seed(0)
    table = PageTable(num_pages=160, page_size=page_size, max_requests=4,
                      max_pages_per_request=80, device=DEV)
    table.allocator._free.reverse()  # hand out high page ids first: pages not in slot order
    lens = [1, 37, 70]
    for i, n in enumerate(lens):
        table.add(f"r{i}")
        table.extend(f"r{i}", n)
    table.flush()
    slots = 160 * page_size
    k, v = torch.randn(slots, kv_heads, head_dim), torch.randn(slots, kv_heads, head_dim)
    q = torch.randn(len(lens), heads, head_dim)
    rows = torch.tensor([table.entries[f"r{i}"].row for i in range(len(lens))])
    seq_lens = torch.tensor(lens)
    kw = dict(req_to_page=table.req_to_page, rows=rows, seq_lens=seq_lens, page_size=page_size,
              scale=head_dim ** -0.5)
    ref = decode_attention_ref(q, k, v, max_len=max(lens), **kw)
    for splits in (1, 3):
        out = decode_attention(q, k, v, num_splits=splits, **kw)
        assert torch.allclose(out, ref, atol=1e-5, rtol=0), splits


def test_fused_kernels_match_torch(on_dev, request):
    if ran_in_child(request):
        return
    for dtype in (torch.float32, torch.bfloat16):
        check_fused_kernels(dtype)


def check_fused_kernels(dtype: torch.dtype) -> None:
    from rltool.engine import fused

    torch.manual_seed(1)
    T, hidden = 5, 96
    # The interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest): bf16 is compared to
    # within an ulp or two, fp32 tightly.
    tol = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    x, res = (torch.randn(T, hidden, dtype=dtype) for _ in range(2))
    w = torch.randn(hidden, dtype=dtype)
    want_out, want_res = fused.add_rms_norm_ref(x, res, w, 1e-6)
    got_out, got_res = fused.add_rms_norm(x, res.clone(), w, 1e-6)
    assert torch.allclose(got_res.float(), want_res.float(), **tol)
    assert torch.allclose(got_out.float(), want_out.float(), **tol)
    assert torch.allclose(fused.add_rms_norm(x, None, w, 1e-6)[0].float(),
                          fused.add_rms_norm_ref(x, None, w, 1e-6)[0].float(), **tol)
    gu = torch.randn(T, 2 * 80, dtype=dtype)
    assert torch.allclose(fused.silu_mul(gu).float(), fused.silu_mul_ref(gu).float(), **tol)
    # RoPE on strided views of a fused qkv, with the KV-cache write.
    H, KVH, D = 6, 2, 16
    qkv = torch.randn(T, (H + 2 * KVH) * D, dtype=dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([torch.outer(torch.arange(64).float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    pos = torch.tensor([0, 3, 17, 63, 5])
    loc = torch.tensor([9, 2, 4, 0, 7])
    outs = []
    for fn in (fused.rope_store_ref, fused.rope_store):
        t = qkv.clone()
        q, k, v = t.split([H * D, KVH * D, KVH * D], dim=-1)
        q, k, v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)
        kc, vc = torch.zeros(10, KVH, D, dtype=dtype), torch.zeros(10, KVH, D, dtype=dtype)
        fn(q, k, v, cos, sin, pos, k_cache=kc, v_cache=vc, loc=loc)
        outs.append((t, kc, vc))
    for a, b in zip(*outs):
        assert torch.allclose(a.float(), b.float(), **tol)


def test_model_with_fused_kernels_matches_unfused(tiny_model_factory, request):
    if ran_in_child(request):
        return
    from rltool.engine.paged_runner import PagedRunner

    seq = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2]
    for arch in ("qwen2", "qwen3"):
        runner = PagedRunner(tiny_model_factory(arch, 0), device=DEV, dtype="fp32",
                             max_running=2, page_size=4, max_total_tokens=64,
                             disable_cuda_graph=True)
        runner.model.fused = False
        ref = runner.full_pass_logits(seq, start=1)
        runner.model.fused = True
        assert torch.allclose(runner.full_pass_logits(seq, start=1), ref, atol=1e-5)


def test_sampling_kernel_logprobs_greedy_and_distribution(on_dev, request):
    if ran_in_child(request):
        return
    from rltool.engine.sampling_kernel import sample_rows


    torch.manual_seed(2)
    logits = torch.randn(4, 3000) * 4
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0])
    greedy = torch.tensor([1, 0, 0, 0], dtype=torch.int32)
    seeds = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    tokens, lps = sample_rows(logits, temps, seeds, greedy, block=512)
    ref = torch.log_softmax(logits / temps[:, None], dim=-1)
    assert tokens[0] == logits[0].argmax()
    assert torch.allclose(lps, ref.gather(1, tokens[:, None]).squeeze(1), atol=1e-5)
    # The same seed gives the same draw in any row; draws follow softmax(logits / T).
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 150  # the interpreter runs ~20 programs/s; the GPU test checks 20k draws tightly
    rows = probs.log().repeat(n, 1)
    toks, _ = sample_rows(rows, torch.ones(n), torch.arange(n, dtype=torch.int32),
                          torch.zeros(n, dtype=torch.int32), block=16)
    again, _ = sample_rows(rows[:3], torch.ones(3), torch.tensor([7, 8, 9], dtype=torch.int32),
                           torch.zeros(3, dtype=torch.int32), block=16)
    assert again.tolist() == toks[7:10].tolist()
    freq = torch.bincount(toks, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.13, freq  # 3.2 sd at p = 0.5


def test_batch_invariant_ops(on_dev, request):
    """The batch-invariant matmul, mean and log-softmax: close to torch's, and a row's result
    bit-identical whatever else is in the batch and wherever the row sits in it."""
    if ran_in_child(request):
        return
    from rltool import batch_invariant as bi

    torch.manual_seed(3)
    w, bias, x = torch.randn(130, 70), torch.randn(130), torch.randn(37, 70)
    full = bi.mm(x, w.t(), bias)
    assert torch.allclose(full, x @ w.t() + bias, atol=1e-4)
    assert torch.equal(bi.mm(x[5:9], w.t(), bias), full[5:9])
    assert torch.equal(bi.mm(x[20:21], w.t(), bias), full[20:21])
    with bi.enabled(DEV):
        linear = torch.nn.functional.linear(x[3:40:4], w, bias)
        mean = x.pow(2).mean(-1, keepdim=True)
        one_mean = x[7:8].pow(2).mean(-1, keepdim=True)
        lsm = torch.log_softmax(x, dim=-1)
        one_lsm = torch.log_softmax(x[11:12], dim=-1)
    assert torch.equal(linear, full[3:40:4])
    assert torch.allclose(mean, x.pow(2).mean(-1, keepdim=True), atol=1e-6)
    assert torch.equal(one_mean[0], mean[7]) and torch.equal(one_lsm[0], lsm[11])
    assert torch.allclose(lsm, torch.log_softmax(x, dim=-1), atol=1e-5)


def test_deterministic_mode_is_batch_invariant(tiny_model_dir, request):
    """--deterministic on the paged engine: a seeded sampled request gives the same tokens and
    the same logprobs alone and as one of 16 requests prefilled and decoded together."""
    if ran_in_child(request):
        return

    def run(prompts):
        return generate_deterministic(tiny_model_dir, prompts, device=DEV, dtype="fp32",
                                      max_new_tokens=4, max_total_tokens=1024,
                                      max_prefill_tokens=256, chunked_prefill_size=8)[0]

    target = [5, 9, 3, 17, 22, 8, 30, 11, 4, 2, 19]  # two prefill chunks of 8
    others = [[(7 * i + j) % 50 + 3 for j in range(3 + i % 9)] for i in range(15)]
    alone = run([target])
    crowd = run([target] + others)
    assert alone[0] == crowd[0] and alone[1] == crowd[1], (alone, crowd)
    assert len(alone[0]) == 4


def test_fp8_gemm_within_analytic_bound(on_dev, request):
    """The block-FP8 GEMM (activations quantized per token and K-block by its own kernel) equals
    its float64 reference to float32 accumulation error, and the unquantized product within the
    analytic bound derived from the block scales (tests/helpers/fp8_gemm.py), which the same
    math with the scales of the wrong K-block violates. Shapes cover the decode path (transposed
    product; split K with a bias), the prefill path (64- and 128-row tiles, split K), partial K-
    and N-blocks, 32- and 128-wide K-blocks, and scales in either memory layout."""
    if ran_in_child(request):
        return
    from rltool.convert.fp8 import quantize_blocks_torch
    from rltool.engine.fp8_gemm import config, fp8_linear
    from tests.helpers.fp8_gemm import error_bound, fp8_linear_float64

    torch.manual_seed(5)
    paths = set()
    for m, n, k, block_k, bias, kb_major in [(1, 40, 200, 128, False, False),
                                             (5, 72, 1024, 128, True, True),
                                             (33, 24, 80, 32, False, False),
                                             (70, 136, 256, 128, True, True),
                                             (130, 40, 256, 32, False, True)]:
        cfg = config(m, n, -(-k // block_k), 8)
        paths.add((cfg["SWAP"], cfg["split"] > 1))
        # K-blocks of magnitudes 1 and 1/64: a scale taken from the wrong block shows
        w = torch.randn(n, k) * 0.05 * 64.0 ** -(torch.arange(k) // block_k % 2).float()
        w[3, 7] = 4.0  # an outlier: its block's scale is large
        q, block_scale = quantize_blocks_torch(w, (block_k, block_k))
        scale = block_scale.repeat_interleave(block_k, dim=0)[:n]
        dev_scale = scale.t().contiguous().t() if kb_major else scale
        x = torch.randn(m, k) * 3
        x[0, :5] = torch.tensor([0.0, -0.0, 1e-9, 300.0, -2.5])
        b = torch.randn(n) if bias else None
        for xin in (x, x.to(torch.bfloat16)):
            got = fp8_linear(xin, q.to(DEV), dev_scale.to(DEV), block_k=block_k,
                             bias=b).double().cpu()
            xc = xin.cpu()
            want = fp8_linear_float64(xc, q, scale, block_k, b.cpu() if bias else None)
            ulp = torch.finfo(xin.dtype).eps  # the interpreter truncates casts to bf16
            assert ((got - want).abs() <= ulp * want.abs() + 1e-5 * want.abs().max()
                    + 1e-6).all(), (m, n, k, xin.dtype)
            exact, bound = error_bound(xc, w, scale, block_k, xin.dtype)
            exact = exact + (b.cpu().double() if bias else 0)
            assert ((got - exact).abs() <= bound).all(), (m, n, k, xin.dtype)
            wrong = fp8_linear_float64(xc, q, scale.roll(1, dims=1), block_k,
                                       b.cpu() if bias else None)
            assert ((wrong - exact).abs() > bound).any(), (m, n, k, xin.dtype)
    assert paths == {(True, False), (True, True), (False, False), (False, True)}


def test_fp8_activation_quantization(on_dev, request):
    """The activation kernel writes the reference's e4m3 bytes and scales (K-block-major), and
    rows past M (the padding cuBLASLt's block scales want) as zeros with the floor scale."""
    if ran_in_child(request):
        return
    from rltool.engine.fp8_gemm import quantize_activations
    from tests.helpers.fp8_gemm import activation_scales

    torch.manual_seed(7)
    x = torch.randn(3, 200) * 5
    x[1, :128] = 0.0  # an all-zero K-block: the floor scale
    want_s = activation_scales(x, 128)
    want_q = (x / want_s.repeat_interleave(128, dim=1)[:, :200]).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    q, s = quantize_activations(x.to(DEV), 128, rows=8)
    assert q.shape == (8, 200) and s.shape == (2, 8)
    assert torch.equal(q[:3].cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s[:, :3].cpu(), want_s.t())
    assert not q[3:].cpu().float().any()
    assert torch.equal(s[:, 3:].cpu(), torch.full((2, 5), 1e-12) / 448)


def test_fp8_resident_model_is_close_to_dequantized(on_dev, request, tiny_model_factory,
                                                     tmp_path):
    """A block-FP8 checkpoint loaded with its linears kept in FP8 (the CUDA path: fused q/k/v and
    gate/up with per-row block scales, stacked MoE experts) against the same checkpoint
    dequantized at load: log-probabilities within the measured effect of quantizing activations
    (max |difference| measured 0.025 and 0.017 nats)."""
    if ran_in_child(request):
        return
    from rltool.convert.fp8 import Fp8Config, quantize_checkpoint
    from rltool.engine.dense_model import LINEAR_KEYS, load_model

    ids = torch.tensor([3, 9, 4, 17, 22, 5, 8, 30, 11, 2])
    for arch, block in [("qwen2", (16, 32)), ("qwen3_moe", (32, 32))]:
        out = tmp_path / arch
        quantize_checkpoint(Fp8Config(hf=tiny_model_factory(arch, 0), out=out, block=block,
                                      workers=1))
        logprobs = []
        for resident in (False, True):
            model = load_model(out, device=DEV, dtype=torch.float32, fp8_resident=resident)
            keys = {(i, key) for i, L in enumerate(model.layers) for key in L
                    if key in LINEAR_KEYS}
            assert model.fp8_keys == (keys if resident else set())
            logprobs.append(torch.log_softmax(
                model.logits(model.hidden(ids, sdpa_attend(model, len(ids)))), -1))
        diff = (logprobs[0] - logprobs[1]).abs().max().item()
        assert 0 < diff < 0.05, (arch, diff)


def sdpa_attend(model, length: int):
    """An `attend` for `DenseLM.hidden` of one causal sequence of `length` tokens from
    position 0: the model's RoPE, then torch's attention."""
    import torch.nn.functional as F

    pos = torch.arange(length)

    def attend(layer, q, k, v):
        model.rope_store(q, k, v, pos)
        return F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=True).transpose(0, 1)

    return attend


def test_fp8_quantization_fused_into_norm_and_silu(on_dev, request, tiny_model_factory,
                                                   tmp_path, monkeypatch):
    """RMSNorm (with and without the residual add) and SiLU-and-multiply writing their output
    already quantized for the block-FP8 GEMM: the same e4m3 bytes and scales (padding rows
    included) as the unfused kernel followed by the quantization kernel, the same residual, and
    the same GEMM result; an FP8-resident model with the fused kernels gives the same logits as
    with the quantization separate."""
    if ran_in_child(request):
        return
    from rltool.convert.fp8 import Fp8Config, quantize_blocks_torch, quantize_checkpoint
    from rltool.engine import dense_model, fp8_gemm, fused

    torch.manual_seed(11)

    def same(got, want):
        assert (got.m, got.dtype) == (want.m, want.dtype)
        assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
        assert torch.equal(got.s, want.s)

    for dtype, T, hidden, inter, block_k in [(torch.bfloat16, 5, 200, 1100, 128),
                                             (torch.float32, 4, 96, 80, 32)]:
        x, res = (torch.randn(T, hidden, dtype=dtype) * 3 for _ in range(2))
        w = torch.randn(hidden, dtype=dtype)
        x[1, :32] = -res[1, :32]  # an all-zero K-block after the add: the floor scale
        for r in (res, None):
            want, want_res = fused.add_rms_norm(x, None if r is None else r.clone(), w, 1e-6)
            got, got_res = fused.add_rms_norm(x, None if r is None else r.clone(), w, 1e-6,
                                              block_k)
            same(got, fp8_gemm.activations(want, block_k))
            assert torch.equal(got_res, want_res)
        gu = torch.randn(T, 2 * inter, dtype=dtype)
        gu[2, :block_k] = 0.0
        got = fused.silu_mul(gu, block_k)
        same(got, fp8_gemm.activations(fused.silu_mul(gu), block_k))
        assert got.q.shape == (fp8_gemm.padded_rows(T), inter) and not got.q[T:].float().any()
        q, block_scale = quantize_blocks_torch(torch.randn(24, inter) * 0.05, (block_k, block_k))
        scale = block_scale.repeat_interleave(block_k, dim=0)[:24]
        assert torch.equal(fp8_gemm.fp8_linear(got, q, scale, block_k=block_k),
                           fp8_gemm.fp8_linear(fused.silu_mul(gu), q, scale, block_k=block_k))
    quantize_checkpoint(Fp8Config(hf=tiny_model_factory("qwen2", 0), out=tmp_path / "fp8",
                                  block=(32, 32), workers=1))
    model = dense_model.load_model(tmp_path / "fp8", device=DEV, dtype=torch.float32,
                                   fp8_resident=True)
    model.fused = True
    ids = torch.tensor([3, 9, 4, 17, 22, 5, 8, 30, 11, 2])
    logits = model.logits(model.hidden(ids, sdpa_attend(model, len(ids))))
    monkeypatch.setattr(dense_model, "fp8_input", lambda w: None)
    assert torch.equal(model.logits(model.hidden(ids, sdpa_attend(model, len(ids)))), logits)


def test_fp8_kv_kernels_match_reference(on_dev, request):
    """FP8 KV cache: the fused RoPE + cache write stores the reference's bytes and per-(token,
    head) scales, and split-KV decode attention over that cache matches the torch reference
    (which dequantizes to float32) for GQA groups, pages out of order and several splits."""
    if ran_in_child(request):
        return
    from rltool.engine import fused
    from rltool.engine.decode_attention import decode_attention

    torch.manual_seed(2)
    T, H, KVH, D = 5, 6, 2, 16
    qkv = torch.randn(T, (H + 2 * KVH) * D) * 3
    qkv[1, H * D:(H + 1) * D] = 0.0  # an all-zero head: scale at the floor, zeros stored
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([torch.outer(torch.arange(64).float(), inv)] * 2, dim=-1)
    pos, loc = torch.tensor([0, 3, 17, 63, 5]), torch.tensor([9, 2, 4, 0, 7])
    outs = []
    for fn in (fused.rope_store_ref, fused.rope_store):
        t = qkv.clone()
        q, k, v = (x.view(T, -1, D) for x in t.split([H * D, KVH * D, KVH * D], dim=-1))
        kc, vc = (torch.zeros(10, KVH, D, dtype=torch.float8_e4m3fn) for _ in range(2))
        ks, vs = torch.ones(10, KVH), torch.ones(10, KVH)
        fn(q, k, v, emb.cos(), emb.sin(), pos, k_cache=kc, v_cache=vc, loc=loc, k_scale=ks,
           v_scale=vs)
        outs.append((t, kc, vc, ks, vs))
    for name, a, b in zip(["qkv", "k_cache", "v_cache", "k_scale", "v_scale"], *outs):
        assert torch.equal(a.float(), b.float()), name  # values: the kernel may store -0 for 0

    for heads, kv_heads, head_dim, page_size in [(4, 2, 16, 4), (8, 2, 32, 16)]:
        table = PageTable(num_pages=160, page_size=page_size, max_requests=4,
                          max_pages_per_request=80, device=DEV)
        table.allocator._free.reverse()
        lens = [1, 37, 70]
        for i, n in enumerate(lens):
            table.add(f"r{i}")
            table.extend(f"r{i}", n)
        table.flush()
        slots = 160 * page_size
        k = (torch.randn(slots, kv_heads, head_dim) * 4).to(torch.float8_e4m3fn)
        v = (torch.randn(slots, kv_heads, head_dim) * 4).to(torch.float8_e4m3fn)
        ks, vs = torch.rand(slots, kv_heads) + 0.01, torch.rand(slots, kv_heads) + 0.01
        q = torch.randn(len(lens), heads, head_dim)
        kw = dict(req_to_page=table.req_to_page,
                  rows=torch.tensor([table.entries[f"r{i}"].row for i in range(len(lens))]),
                  seq_lens=torch.tensor(lens), page_size=page_size, scale=head_dim ** -0.5,
                  k_scale=ks, v_scale=vs)
        ref = decode_attention_ref(q, k, v, max_len=max(lens), **kw)
        for splits in (1, 3):
            out = decode_attention(q, k, v, num_splits=splits, **kw)
            assert torch.allclose(out, ref, atol=1e-5, rtol=0), splits


def test_decode_attention_writes_o_proj_input_quantized(on_dev, request):
    """Stage 2 writing its output quantized for an FP8 o_proj (heads holding one or two whole
    K-blocks, bf16 and fp32, model-dtype and FP8 caches): the e4m3 bytes and scales of the
    unquantized output followed by fp8_gemm's quantization kernel, padding rows included (zeros,
    floor scale), an all-zero head at the floor scale; a K-block spanning heads falls back to
    the unquantized output, bit-equal to a call without `block_k`."""
    if ran_in_child(request):
        return
    from rltool.engine import fp8_gemm
    from rltool.engine.decode_attention import decode_attention

    torch.manual_seed(5)
    lens = [1, 37, 50]
    for dtype, heads, kv_heads, head_dim, block_k, cache in [
            (torch.bfloat16, 4, 2, 64, 32, "auto"), (torch.float32, 2, 1, 128, 128, "fp8"),
            (torch.bfloat16, 4, 2, 32, 32, "fp8"), (torch.bfloat16, 4, 2, 16, 32, "auto")]:
        table = PageTable(num_pages=40, page_size=4, max_requests=4, max_pages_per_request=20,
                          device=DEV)
        table.allocator._free.reverse()
        for i, n in enumerate(lens):
            table.add(f"r{i}")
            table.extend(f"r{i}", n)
        table.flush()
        k, v = (torch.randn(160, kv_heads, head_dim) * 3 for _ in range(2))
        v[:, 0] = 0.0  # the first KV head's query heads output zeros: the floor scale
        kw = dict(req_to_page=table.req_to_page,
                  rows=torch.tensor([table.entries[f"r{i}"].row for i in range(len(lens))]),
                  seq_lens=torch.tensor(lens), page_size=4, scale=head_dim ** -0.5,
                  num_splits=3)
        if cache == "fp8":
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            kw.update(k_scale=torch.rand(160, kv_heads) + 0.01,
                      v_scale=torch.rand(160, kv_heads) + 0.01)
        else:
            k, v = k.to(dtype), v.to(dtype)
        q = torch.randn(len(lens), heads, head_dim).to(dtype)
        plain = decode_attention(q, k, v, **kw)
        got = decode_attention(q, k, v, block_k=block_k, **kw)
        if head_dim % block_k:
            assert torch.equal(got, plain)
            continue
        want = fp8_gemm.activations(plain.reshape(len(lens), -1), block_k)
        assert (got.m, got.dtype, got.q.shape, got.s.shape) == (
            want.m, want.dtype, want.q.shape, want.s.shape)
        assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
        assert torch.equal(got.s, want.s)
        assert not got.q[len(lens):].float().any()
        assert torch.equal(got.s[0], torch.full_like(got.s[0], 1e-12) / 448)


def test_fp8_model_decodes_with_o_proj_input_from_attention(on_dev, request, tmp_path,
                                                         tiny_model_factory):
    """An FP8-resident model (the tiny qwen2's weights read as 2 heads of 32 over 1 KV head:
    the same tensor shapes; 32x32 blocks, one K-block per head) decoding a batch over a paged
    cache, its attention handing o_proj's input back quantized: the logits of the same step with
    the input quantized by the GEMM's own kernel, bit for bit."""
    if ran_in_child(request):
        return
    import json
    import shutil

    from rltool.convert.fp8 import Fp8Config, quantize_checkpoint
    from rltool.engine.decode_attention import decode_attention
    from rltool.engine.dense_model import fp8_input, load_model

    src = shutil.copytree(tiny_model_factory("qwen2", 0), tmp_path / "bf16")
    config = json.loads((src / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=1)
    (src / "config.json").write_text(json.dumps(config))
    quantize_checkpoint(Fp8Config(hf=src, out=tmp_path / "fp8", block=(32, 32), workers=1))
    model = load_model(tmp_path / "fp8", device=DEV, dtype=torch.float32, fp8_resident=True)
    model.fused = True
    s = model.spec
    assert s.head_dim == 32 and model.fp8_keys
    torch.manual_seed(3)
    table = PageTable(num_pages=16, page_size=4, max_requests=4, max_pages_per_request=4,
                      device=DEV)
    lens = [5, 9, 2]
    for i, n in enumerate(lens):
        table.add(f"r{i}")
        table.extend(f"r{i}", n)
    table.flush()
    caches = [[torch.randn(64, s.num_kv_heads, s.head_dim) for _ in range(2)]
              for _ in range(s.num_layers)]
    rows = torch.tensor([table.entries[f"r{i}"].row for i in range(len(lens))])
    loc = torch.tensor([table.slots(f"r{i}", n - 1, n)[0] for i, n in enumerate(lens)])
    kinds = []

    def attend_quantizing(quantize: bool):
        def attend(layer, q, k, v):
            kc, vc = caches[layer]
            model.rope_store(q, k, v, torch.tensor(lens) - 1, k_cache=kc, v_cache=vc, loc=loc)
            out = decode_attention(q, kc, vc, req_to_page=table.req_to_page, rows=rows,
                                   seq_lens=torch.tensor(lens), page_size=4,
                                   scale=s.head_dim ** -0.5, num_splits=2,
                                   block_k=fp8_input(model.layers[layer]["o"]) if quantize
                                   else None)
            kinds.append(type(out).__name__)
            return out
        return attend

    ids = torch.tensor([3, 9, 4])
    logits = [model.logits(model.hidden(ids, attend_quantizing(quantize)))
              for quantize in (True, False)]
    assert kinds == ["Fp8Activations"] * s.num_layers + ["Tensor"] * s.num_layers
    assert torch.equal(logits[0], logits[1])


# ----- multi-step decode (--num-continuous-decode-steps) on the Triton sampler ------------------

class Engine:
    """A paged runner + scheduler on CPU whose decode steps run through the Triton sampler (the
    overlapped path), `steps` decode steps per block; requests seeded, so runs are comparable."""

    def __init__(self, model_dir, steps: int):
        from rltool.engine.paged_runner import PagedRunner
        from rltool.engine.paged_scheduler import PagedScheduler

        self.runner = PagedRunner(model_dir, device=DEV, dtype="fp32", max_running=4, page_size=4,
                                  max_total_tokens=256, cuda_graph_max_bs=4)
        self.sched = PagedScheduler(self.runner, max_running=4, max_prefill_tokens=64,
                                    num_continuous_decode_steps=steps)
        self.full = self.runner.free_pages()
        self.sched.start()

    def submit(self, specs: list[dict]) -> list:
        import threading

        from rltool.engine.request import Request
        from rltool.engine.sampling import SamplingParams, make_generator

        left = [len(specs)]
        self.done, self.tokens = threading.Event(), threading.Event()

        def on_finish(_req):
            left[0] -= 1
            if left[0] == 0:
                self.done.set()

        def on_token(req):
            if len(req.output_ids) >= 2:  # decoding has started
                self.tokens.set()

        reqs = []
        for i, spec in enumerate(specs):
            spec = dict(spec)
            prompt = spec.pop("prompt", [5 + i, 9, 3 + 2 * i, 17, 22, 8][:3 + i % 4])
            reqs.append(Request(rid=f"r{i}", prompt_ids=prompt, return_logprob=True,
                                generator=make_generator(40 + i), on_finish=on_finish,
                                on_token=on_token, params=SamplingParams(**spec)))
        self.sched.submit(reqs)
        return reqs

    def run(self, specs: list[dict]) -> list:
        reqs = self.submit(specs)
        assert self.done.wait(300)
        return reqs

    def stop(self):
        self.sched.stop()


def outputs(reqs) -> list:
    return [(r.output_ids, r.output_logprobs, r.finish_reason, r.weight_spans()) for r in reqs]


MIXED = [dict(max_new_tokens=10, temperature=0.0, ignore_eos=True),
         dict(max_new_tokens=10, temperature=1.0, ignore_eos=True),
         dict(max_new_tokens=10, temperature=0.7, ignore_eos=True),
         dict(max_new_tokens=10, temperature=1.3, min_new_tokens=2, ignore_eos=True)]


def test_multistep_decode_equals_single_steps(tiny_model_dir, request):
    """A mixed batch (greedy, sampled at several temperatures, one with min_new_tokens, so its
    first steps race over draw logits with its stop ids masked) gives the same tokens and
    bit-identical logprobs with 4 decode steps per block as with 1, in fewer host round trips,
    and frees every page."""
    if ran_in_child(request):
        return
    runs = {}
    for steps in (1, 4):
        engine = Engine(tiny_model_dir, steps)
        try:
            runs[steps] = outputs(engine.run(MIXED))
            assert engine.runner.free_pages() == engine.full
            assert engine.sched.num_decode_forwards >= 9
        finally:
            engine.stop()
    assert runs[4] == runs[1]
    assert all(len(out[0]) == 10 for out in runs[1])


def test_multistep_stops_inside_a_block(tiny_model_dir, request):
    """EOS, a stop token id, a stop string and max_new_tokens each land inside a block of 4:
    the request ends where it does with 1 step per block, tokens after its stop are dropped,
    and its reserved KV pages are freed."""
    if ran_in_child(request):
        return
    ref = Engine(tiny_model_dir, 1)
    try:
        free = [out[0] for out in outputs(ref.run([dict(max_new_tokens=12, temperature=1.0,
                                                        ignore_eos=True)] * 3))]
    finally:
        ref.stop()

    def first_new(seq: list[int], at: int) -> int:
        """An index >= at whose token is not among the ones before it."""
        return next(i for i in range(at, len(seq)) if seq[i] not in seq[:i])

    eos_at, stop_at, text_at = first_new(free[0], 5), first_new(free[1], 6), first_new(free[2], 2)
    char = ref.runner.tokenizer.decode([free[2][text_at]])
    assert char and char not in ref.runner.tokenizer.decode(free[2][:text_at])
    specs = [dict(max_new_tokens=12, temperature=1.0),  # stops at its EOS
             dict(max_new_tokens=12, temperature=1.0, ignore_eos=True,
                  stop_token_ids=[free[1][stop_at]]),
             dict(max_new_tokens=12, temperature=1.0, ignore_eos=True),  # stop string: below
             dict(max_new_tokens=7, temperature=1.0, ignore_eos=True)]
    runs = {}
    for steps in (1, 4):
        engine = Engine(tiny_model_dir, steps)
        try:
            engine.runner.eos_token_ids = {free[0][eos_at]}
            specs[2]["stop"] = [char]
            runs[steps] = outputs(engine.run(specs))
            assert engine.runner.free_pages() == engine.full
        finally:
            engine.stop()
    for one, four in zip(runs[1], runs[4]):
        assert four[0] == one[0] and four[2] == one[2] and four[3] == one[3]
        assert four[1] == pytest.approx(one[1], abs=1e-5)  # batch shapes differ after a stop
    got = runs[4]
    assert len(got[0][0]) == eos_at + 1 and got[0][2]["type"] == "stop"
    assert len(got[1][0]) == stop_at + 1 and got[1][2] == {"type": "stop",
                                                            "matched": free[1][stop_at]}
    assert len(got[2][0]) == text_at + 1 and got[2][2]["type"] == "stop"
    assert len(got[3][0]) == 7 and got[3][2]["type"] == "length"


LONG = 18  # > the tokens a request can have when a pause lands: 1 + 3 blocks of 4


def test_multistep_control_operations(tiny_model_dir, other_weights_dir, request):
    """With 4 decode steps per block: abort and each pause mode during generation, and an
    in_place weight update between blocks (the response's weight-version spans split where the
    update came); greedy tokens as without the interruption; every page back at the end."""
    if ran_in_child(request):
        return
    greedy = [dict(max_new_tokens=LONG, temperature=0.0, ignore_eos=True)] * 2
    engine = Engine(tiny_model_dir, 4)
    sched, runner = engine.sched, engine.runner
    try:
        plain = outputs(engine.run(greedy))
        reqs = engine.submit(greedy)  # abort
        assert engine.tokens.wait(300)
        assert sched.call(lambda: sched.abort(abort_all=True)).result(60) == 2
        assert engine.done.wait(60) and all(r.finish_reason["type"] == "abort" for r in reqs)
        assert runner.free_pages() == engine.full
        for mode in ("abort", "retract", "in_place"):
            reqs = engine.submit(greedy)
            assert engine.tokens.wait(300)
            sched.call(lambda: sched.pause(mode)).result(60)
            held = [len(r.output_ids) for r in reqs]
            if mode == "retract":
                assert runner.free_pages() == engine.full
            sched.call(lambda: None).result(60)  # a loop iteration while paused: no step
            assert [len(r.output_ids) for r in reqs] == held
            sched.call(sched.resume_generation).result(60)
            assert engine.done.wait(300)
            if mode == "abort":
                assert all(r.finish_reason["type"] == "abort" for r in reqs)
            else:
                assert [r.output_ids for r in reqs] == [p[0] for p in plain]
        reqs = engine.submit(greedy)  # in_place weight update between blocks
        assert engine.tokens.wait(300)
        sched.call(lambda: sched.pause("in_place")).result(60)
        held = [len(r.output_ids) for r in reqs]

        def apply():
            runner.load_weights(other_weights_dir)
            runner.weight_version = "v2"

        sched.update_weights(apply, abort_all=False).result(60)
        sched.call(sched.resume_generation).result(60)
        assert engine.done.wait(300)
        for r, n in zip(reqs, held):
            assert r.weight_spans() == [{"version": "default", "start": 0, "end": n},
                                        {"version": "v2", "start": n, "end": LONG}]
        assert runner.free_pages() == engine.full
    finally:
        engine.stop()
