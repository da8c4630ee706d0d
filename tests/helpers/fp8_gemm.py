"""References for the block-FP8 GEMM (rltool.engine.fp8_gemm): its quantized math in float64, and
the analytic bound on its distance from the unquantized product.

The bound, per output (m, n), with x the activations and w the float weight:

    |y - x @ w.T| <= sum_k ex_k |w_k| + sum_k |x^_k| ew_k + GAMMA * sum_k |x^_k| |w^_k| + out

- ex, ew: the e4m3 rounding error of each operand element, from its block scale s (token and
  K-block for x, the weight's 128x128 block for w): at most half an ulp, 2^-4 of |v| for normals,
  and 2^-10 * s below them (e4m3's subnormal spacing is 2^-9 of the scale unit); x^, w^ are the
  dequantized operands (|x^| <= |x| + ex).
- GAMMA: the tensor-core accumulation. Hopper's FP8 MMA keeps about 14 significant bits in its
  accumulator (DeepSeek-V3 technical report, section 3.3.2, "Increasing Accumulation Precision":
  limited to retaining around 14 bits, hence the promotion to float32 every 128 K-elements, which
  both GEMMs do). With unit u = 2^-13 per addition and a 128-wide block summed as four chained
  k=32 MMA instructions, each reducing its 32 products in a tree of depth log2(32) = 5, every
  product passes through at most 5 + 4 = 9 additions: GAMMA = 9 u (the summation-tree bound
  d * u * sum|terms|). The float32 promotion, the scale products and the float32 sum over blocks
  add < 2^-20 of the same sum.
- out: the cast to the output dtype, one ulp of |y| (half on a GPU, which rounds to nearest;
  Triton's interpreter truncates).
"""

from __future__ import annotations

import torch

GAMMA = 9 * 2.0 ** -13
FLOAT32_TERMS = 2.0 ** -20


def per_element(scales: torch.Tensor, block: int, size: int) -> torch.Tensor:
    """[..., ceil(size / block)] block scales -> [..., size]."""
    return scales.repeat_interleave(block, dim=-1)[..., :size]


def activation_scales(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """The kernels' activation scales, float32 [M, ceil(K / block_k)]: max(max|x|, 1e-12) / 448
    per token and K-block."""
    M, K = x.shape
    pad = -K % block_k
    a = torch.nn.functional.pad(x.float().abs(), (0, pad)).view(M, -1, block_k)
    return a.amax(dim=2).clamp(min=1e-12) / 448


def e4m3_error(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Bound of |v - dequant(quant(v))| for v quantized with (per-element) scale, float64; a
    2^-10 relative margin for the float32 division before rounding."""
    v, scale = v.double(), scale.double()
    return torch.maximum(v.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 2.0 ** -10)


def fp8_linear_float64(x, q, scale, block_k, bias=None):
    """The block-FP8 GEMM's math in float64 after the same float32 activation quantization:
    per token and K-block, s = max(max|x|, 1e-12) / 448, e4m3(clamp(x / s, ±448)); `scale`
    [N, Kb] (one float32 per weight row and K-block)."""
    out = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64, device=x.device)
    for b in range(scale.shape[1]):
        a = x[:, b * block_k:(b + 1) * block_k].float()
        sa = a.abs().amax(dim=1).clamp(min=1e-12) / 448
        aq = (a / sa[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        out += ((aq.double() @ q[:, b * block_k:(b + 1) * block_k].double().T)
                * sa.double()[:, None] * scale[:, b].double()[None, :])
    return out if bias is None else out + bias.double()


def error_bound(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_k: int,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact x @ w.T in float64, the bound above) for activations x [M, K], the float weight w
    [N, K] and its per-row block scales w_scale [N, Kb]."""
    K = x.shape[1]
    xd, wd = x.double(), w.double()
    ex = e4m3_error(xd, per_element(activation_scales(x, block_k), block_k, K))
    ew = e4m3_error(wd, per_element(w_scale, block_k, K))
    x_hat, w_hat = xd.abs() + ex, wd.abs() + ew
    exact = xd @ wd.T
    terms = x_hat @ w_hat.T
    out = torch.finfo(out_dtype).eps * (exact.abs() + ex @ w_hat.T + x_hat @ ew.T
                                                         + GAMMA * terms)
    bound = ex @ wd.abs().T + x_hat @ ew.T + (GAMMA + FLOAT32_TERMS) * terms + out
    return exact, bound
