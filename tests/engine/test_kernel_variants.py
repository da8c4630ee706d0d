"""The engine's Triton kernels compile one variant whatever the batch: the specialization Triton
derives from a launch's arguments (an integer equal to 1 or a multiple of 16, a pointer's
alignment) is the same for every batch size a serving run meets. Checked on CPU by binding each
launch's arguments with Triton's own binder, as its JIT does before it looks up or compiles a
variant; the kernels do not run."""

from __future__ import annotations

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from rltool.engine import decode_attention as attention
from rltool.engine import sampling_kernel
from tests.helpers.engines import filled_page_table

BATCHES = (1, 3, 5, 9, 16, 17, 33, 48, 64, 256)


def launch_keys(monkeypatch, module, names: list[str]) -> dict[str, set[tuple[str, ...]]]:
    """Replace the kernels `names` of `module` by recorders of the specialization key of each
    launch (the kernel does not run): {kernel name: the distinct keys seen}."""
    keys: dict[str, set[tuple[str, ...]]] = {}
    for name in names:
        kernel = getattr(module, name)
        assert isinstance(kernel, JITFunction), f"{name}: not a compiled Triton kernel"
        bind = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)

        def launch(grid, name=name, bind=bind):
            def record(*args, **kwargs):
                keys.setdefault(name, set()).add(tuple(map(str, bind(*args, **kwargs)[1])))
            return record

        monkeypatch.setattr(module, name, type(name, (), {"__getitem__": staticmethod(launch)})())
    return keys


@pytest.mark.parametrize("fp8_o_proj", [False, True])
def test_decode_attention_is_one_variant_for_any_batch(monkeypatch, fp8_o_proj):
    """Both stages for 1 to 256 rows, each with the split count `num_splits_for` gives (1 to 32:
    the split buffers' strides follow it), plain and writing o_proj's FP8 input."""
    keys = launch_keys(monkeypatch, attention, ["_stage1", "_stage2"])
    heads, kvh, d, page = 4, 2, 64, 16
    table = filled_page_table(256, 100, num_pages=2048, page_size=page, device="cpu")
    k_cache = v_cache = torch.zeros(2048 * page, kvh, d, dtype=torch.bfloat16)
    splits = set()
    for b in BATCHES:
        splits.add(attention.num_splits_for(b, kvh))
        attention.decode_attention(
            torch.zeros(b, heads, d, dtype=torch.bfloat16), k_cache, v_cache,
            req_to_page=table.req_to_page, rows=torch.arange(1, b + 1),
            seq_lens=torch.full((b,), 100), page_size=page, scale=d ** -0.5,
            num_splits=attention.num_splits_for(b, kvh), block_k=64 if fp8_o_proj else None)
    assert len(splits) > 4 and 1 in splits and attention.MAX_SPLITS in splits, splits
    assert {name: len(seen) for name, seen in keys.items()} == {"_stage1": 1, "_stage2": 1}, keys


def test_sampler_is_one_variant_for_any_batch(monkeypatch):
    """The sampler's two kernels for 1 to 256 rows of a 151,936-token vocabulary."""
    keys = launch_keys(monkeypatch, sampling_kernel, ["_partial", "_combine"])
    vocab = 151_936
    for b in BATCHES:
        ones = torch.ones(b)
        zeros = torch.zeros(b, dtype=torch.int32)
        sampling_kernel.sample_rows(torch.zeros(b, vocab, dtype=torch.bfloat16), ones, zeros,
                                    zeros)
    assert {name: len(seen) for name, seen in keys.items()} == {"_partial": 1, "_combine": 1}, keys


@pytest.mark.parametrize("block_k", [None, 128])
def test_norm_rope_and_silu_are_one_variant_for_any_token_count(monkeypatch, block_k):
    """The fused norm, RoPE + KV write and SiLU kernels (rltool.engine.fused) over 1 to 256
    tokens at the 0.5B shapes, q, k, v as views of one fused projection, unquantized and
    writing FP8 activations."""
    from rltool.engine import fused

    keys = launch_keys(monkeypatch, fused, ["_add_rms_norm", "_rope_store", "_silu_mul"])
    hidden, heads, kvh, d, inter = 896, 14, 2, 64, 4864
    k_cache = v_cache = torch.zeros(4096, kvh, d, dtype=torch.bfloat16)
    cos = sin = torch.zeros(4096, d // 2)
    weight = torch.ones(hidden, dtype=torch.bfloat16)
    for t in BATCHES:
        x = torch.zeros(t, hidden, dtype=torch.bfloat16)
        fused.add_rms_norm(x, x.clone(), weight, 1e-6, block_k=block_k)
        qkv = torch.zeros(t, (heads + 2 * kvh) * d, dtype=torch.bfloat16)
        q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
        fused.rope_store(q.view(t, heads, d), k.view(t, kvh, d), v.view(t, kvh, d), cos, sin,
                         torch.arange(t), k_cache=k_cache, v_cache=v_cache,
                         loc=torch.arange(t))
        fused.silu_mul(torch.zeros(t, 2 * inter, dtype=torch.bfloat16), block_k=block_k)
    assert {name: len(seen) for name, seen in keys.items()} == {
        "_add_rms_norm": 1, "_rope_store": 1, "_silu_mul": 1}, keys
