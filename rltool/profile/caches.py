"""Serving cost models: hybrid (attention + linear-attention) cache, prefill/decode
disaggregation, hierarchical KV cache. Same return shape as rltool/profile/models.py."""

from __future__ import annotations

from typing import Any

from rltool.errors import BadInputError
from rltool.profile.modelcfg import ModelShape
from rltool.profile.models import GIB, Model


def kv_bytes_per_token(shape: ModelShape, *, kv_bits: int) -> float:
    """c_A: 2 (K and V) x attention layers x KV heads x head dim x b/8."""
    return 2 * shape.attention_layers * shape.kv_heads * shape.head_dim * kv_bits / 8


def state_bytes_per_sequence(shape: ModelShape, *, ssm_bits: int, conv_bits: int) -> float:
    """c_R: per linear-attention layer, the recurrent state (value heads x key dim x value dim)
    plus the convolution state ((kernel - 1) x conv channels)."""
    recurrent = shape.lin_v_heads * shape.lin_k_dim * shape.lin_v_dim * ssm_bits / 8
    conv = max(shape.conv_kernel - 1, 0) * shape.conv_dim * conv_bits / 8
    return shape.linear_layers * (recurrent + conv)


def hybrid_cache(shape: ModelShape, *, tokens: int, sequences: int, pool_gib: float, ratio: float,
                 kv_bits: int, ssm_bits: int, conv_bits: int) -> dict[str, Any]:
    if ratio <= 0:
        raise BadInputError(f"--mamba-full-memory-ratio {ratio:g}: must be > 0")
    c_a = kv_bytes_per_token(shape, kv_bits=kv_bits)
    c_r = state_bytes_per_sequence(shape, ssm_bits=ssm_bits, conv_bits=conv_bits)
    pool = pool_gib * GIB
    b_a, b_r = pool / (1 + ratio), ratio * pool / (1 + ratio)
    rows = [{"c_A_bytes_per_token": c_a, "c_R_bytes_per_sequence": c_r,
             "B_cache_gib": (tokens * c_a + sequences * c_r) / GIB,
             "B_A_gib": b_a / GIB, "B_R_gib": b_r / GIB,
             "max_tokens": int(b_a // c_a) if c_a else 0,
             "max_sequences": int(b_r // c_r) if c_r else 0,
             "fits": tokens * c_a <= b_a and sequences * c_r <= b_r}]
    notes = ["B_cache = N*c_A + K*c_R; pools B_A = B/(1+r) (attention KV), B_R = rB/(1+r) "
             "(recurrent + conv states); checked against a live engine by "
             "`rltool plan --check-engine URL`"]
    if not shape.linear_layers:
        notes.append("the model has no linear-attention layers: c_R = 0, the whole pool is KV")
    return Model("hybrid_cache", {
        "attention_layers": shape.attention_layers, "linear_layers": shape.linear_layers,
        "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "linear_value_heads": shape.lin_v_heads, "linear_key_dim": shape.lin_k_dim,
        "linear_value_dim": shape.lin_v_dim, "conv_kernel": shape.conv_kernel,
        "conv_channels": shape.conv_dim, "tokens_N": tokens, "sequences_K": sequences,
        "pool_gib": pool_gib, "ratio_r": ratio, "kv_bits": kv_bits, "ssm_bits": ssm_bits,
        "conv_bits": conv_bits}, rows, notes)


def pd_split(n: int, *, mu_p: float, mu_d: float) -> int:
    """Prefill engines n_P (1..n-1) maximizing min(n_P*mu_P, (n-n_P)*mu_D)."""
    return max(range(1, n), key=lambda k: (min(k * mu_p, (n - k) * mu_d), -k))


def prefill_decode(shape: ModelShape, *, engines: int, mu_p: float, mu_d: float,
                   prompt_tokens: int, kv_bits: int, kv_link_Bps: float) -> dict[str, Any]:
    """lambda <= min(n_P mu_P, n_D mu_D, B_KV / S_KV), S_KV = 2 L layers heads d b/8 (GQA)."""
    if shape.mla:
        raise BadInputError("--model uses MLA/DSA attention (kv_lora_rank or index_topk): the PD "
                            "model's S_KV formula is for GQA/MHA only; leave out --pd")
    if engines < 2:
        raise BadInputError(f"--pd-engines {engines}: PD needs at least 2 engines (1 prefill, "
                            "1 decode)")
    s_kv = prompt_tokens * kv_bytes_per_token(shape, kv_bits=kv_bits)
    n_p = pd_split(engines, mu_p=mu_p, mu_d=mu_d)
    rows = []
    for label, k in (("balanced", n_p), ("even", engines // 2)):
        caps = {"prefill_rps": k * mu_p, "decode_rps": (engines - k) * mu_d,
                "kv_transfer_rps": kv_link_Bps / s_kv if s_kv else float("inf")}
        rows.append({"split": label, "n_P": k, "n_D": engines - k, **caps,
                     "lambda_max_rps": min(caps.values()),
                     "bound_by": min(caps, key=lambda c: caps[c])})
    return Model("prefill_decode", {
        "engines": engines, "mu_P_rps": mu_p, "mu_D_rps": mu_d, "prompt_tokens_L": prompt_tokens,
        "S_KV_bytes": s_kv, "kv_bits": kv_bits, "B_KV_Bps": kv_link_Bps}, rows,
        ["mu_P, mu_D are requests/s per engine; not checkable here (no SGLang PD deployment)"])


def hicache(shape: ModelShape, *, hit_rate: float, prompt_tokens: int, t_prefill_s: float,
            io_Bps: float, t_book_s: float, kv_bits: int, version_lifetime_s: float
            ) -> dict[str, Any]:
    """dt = h t_prefill - t_io - t_book per request, t_io = h L c_A / B_io."""
    if not 0 <= hit_rate <= 1:
        raise BadInputError(f"--hit-rate {hit_rate:g}: must be within [0, 1]")
    t_io = hit_rate * prompt_tokens * kv_bytes_per_token(shape, kv_bits=kv_bits) / io_Bps
    dt = hit_rate * t_prefill_s - t_io - t_book_s
    return Model("hicache", {
        "hit_rate_h": hit_rate, "prompt_tokens_L": prompt_tokens, "t_prefill_s": t_prefill_s,
        "B_io_Bps": io_Bps, "t_book_s": t_book_s, "kv_bits": kv_bits,
        "version_lifetime_s": version_lifetime_s},
        [{"t_io_s": t_io, "saved_per_request_s": dt, "worth_it": dt > 0,
          "validity_window_s": version_lifetime_s}],
        ["cached KV is valid only under the weights that computed it: every weight update "
         "ends the window (flush the cache on update); checked against a builtin engine with "
         "the host KV tier and one without by `rltool plan --check-engine URL "
         "--baseline-engine URL`"])
