"""The Triton split-KV decode kernel against the torch reference, run by Triton's interpreter on
CPU (TRITON_INTERPRET=1, set before triton is imported): pages scattered out of order, lengths
that end mid-page and mid-block, a one-token sequence, GQA groups, and several split counts."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from rltool.engine.paged import PageTable, decode_attention_ref  # noqa: E402


@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [(4, 2, 16, 4), (14, 2, 64, 16),
                                                               (8, 8, 32, 1)])
def test_kernel_matches_reference(heads, kv_heads, head_dim, page_size):
    from rltool.engine.decode_attention import decode_attention

    torch.manual_seed(0)
    table = PageTable(num_pages=160, page_size=page_size, max_requests=4,
                      max_pages_per_request=80, device="cpu")
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
