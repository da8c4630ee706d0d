/* Block-wise FP8 (e4m3fn) quantization and dequantization, one pass per row of blocks.
 *
 * Called through ctypes from rltool/convert/fp8_native.py (ctypes releases the GIL, so the
 * conversion's worker threads run these in parallel). Every result is bit-identical to the torch
 * reference path in rltool/convert/fp8.py (tests compare both on many inputs):
 *   scale = max(max|w|, 1e-12f) / 448.0f                     (fp32)
 *   q     = e4m3fn(w / scale)                                (true fp32 division, RNE cast)
 *   deq   = e4m3fn_to_f32(q) * scale_inv                     (fp32), then cast to the output dtype
 * Plain C, no Python C-API. No -ffast-math: the bit-exactness depends on IEEE division, ordered
 * comparisons and one rounding add; gcc vectorizes the inner loops at -O3 as written.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { RLTOOL_F32 = 0, RLTOOL_BF16 = 1, RLTOOL_F16 = 2 };

/* One specialized copy per ISA level, chosen at load time (glibc ifunc): AVX2/AVX-512 widen the
 * vectors, the default copy runs anywhere x86-64 does. Other platforms get the plain build. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define RLTOOL_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define RLTOOL_CLONES
#endif
/* Forced: gcc does not inline a default-target helper into an arch=x86-64-v4 clone by itself,
 * and an out-of-line call per element kept those loops scalar (measured 3x slower). */
#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Exact fp16 -> fp32 (every fp16 value is an fp32 value); subnormals via an exact multiply. */
INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t normal = ((exp + 112u) << 23) | (man << 13);
    uint32_t special = 0x7F800000u | (man << 13);            /* inf / NaN */
    uint32_t sub = f32_bits((float)man * 0x1p-24f);          /* 0 or subnormal: man * 2^-24 */
    uint32_t mag = exp == 31 ? special : normal;
    mag = exp == 0 ? sub : mag;
    return bits_f32(sign | mag);
}

/* |x| as ordered integers: for non-NaN values the order of the magnitude bits is the order of
 * the values, and NaN patterns sort above inf, so an integer max propagates NaN like torch's
 * amax does (the caller then sees a non-finite scale). */
INLINE float abs_bits_to_f32(uint32_t a, int dtype) {
    if (dtype == RLTOOL_F32) return bits_f32(a);
    if (dtype == RLTOOL_BF16) return bits_f32(a << 16);
    return f16_to_f32((uint16_t)a);
}

/* torch's float -> float8_e4m3fn cast (c10's fp8e4m3fn_from_fp32_value with torch >= 2.x's
 * saturation), branch-free: round to nearest even; |x| >= 448, inf included, saturates to 448
 * (0x7E); NaN gives 0x7F (the format has no inf); values below 2^-6 round to subnormals through
 * one fp32 add of 2^14 (which rounds to the subnormal spacing 2^-9, ties to even). The sign is
 * kept, -0 included. */
INLINE uint8_t f32_to_e4m3(float f) {
    uint32_t b = f32_bits(f);
    uint32_t sign = b & 0x80000000u;
    b ^= sign;
    uint32_t sub = f32_bits(bits_f32(b) + bits_f32(141u << 23)) - (141u << 23);
    uint32_t nor = (b + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
    /* plain selects on values computed unconditionally: gcc turns them into vector blends
     * (integer masks instead measured 1.6x slower: they are widened and narrowed per byte) */
    uint32_t r = b < (121u << 23) ? sub : nor;
    r = b >= 0x43E00000u ? 0x7Eu : r;
    r = b > 0x7F800000u ? 0x7Fu : r;
    return (uint8_t)(r | (sign >> 24));
}

/* c10's fp8e4m3fn_to_fp32_value (exact; 0x7F / 0xFF decode to NaN). */
static float e4m3_to_f32(uint8_t v) {
    uint32_t w = (uint32_t)v << 24;
    uint32_t sign = w & 0x80000000u, nonsign = w & 0x7FFFFFFFu;
    if (nonsign == 0) return bits_f32(sign);
    uint32_t shift = (uint32_t)__builtin_clz(nonsign);
    shift = shift > 4 ? shift - 4 : 0;
    uint32_t inf_nan = (uint32_t)((int32_t)(nonsign + 0x01000000u) >> 8) & 0x7F800000u;
    return bits_f32(sign | (((nonsign << shift >> 4) + ((0x78u - shift) << 23)) | inf_nan));
}

/* torch's float -> bfloat16 (c10::round_to_nearest_even): RNE on the top 16 bits, NaN -> 0x7FC0. */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0u : r;
}

/* Exposed for the exhaustive tests of the cast alone. */
RLTOOL_CLONES void rltool_f32_to_e4m3(const float *x, uint8_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = f32_to_e4m3(x[i]);
}

/* Running max of |x| per column block over one row, on the magnitude bits (see above). */
INLINE void amax_row_u32(const uint32_t *row, int64_t k, int64_t bk, uint32_t *amax) {
    for (int64_t j = 0, c0 = 0; c0 < k; j++, c0 += bk) {
        int64_t c1 = c0 + bk < k ? c0 + bk : k;
        uint32_t m = amax[j];
        for (int64_t c = c0; c < c1; c++) {
            uint32_t a = row[c] & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
        amax[j] = m;
    }
}

INLINE void amax_row_u16(const uint16_t *row, int64_t k, int64_t bk, uint32_t *amax) {
    for (int64_t j = 0, c0 = 0; c0 < k; j++, c0 += bk) {
        int64_t c1 = c0 + bk < k ? c0 + bk : k;
        uint16_t m = (uint16_t)amax[j];
        for (int64_t c = c0; c < c1; c++) {
            uint16_t a = row[c] & 0x7FFFu;
            m = a > m ? a : m;
        }
        amax[j] = m;
    }
}

INLINE void row_to_f32(const void *row, int dtype, int64_t k, float *out) {
    if (dtype == RLTOOL_F32) {
        memcpy(out, row, (size_t)k * sizeof(float));
    } else if (dtype == RLTOOL_BF16) {
        const uint16_t *r = row;
        for (int64_t c = 0; c < k; c++) out[c] = bits_f32((uint32_t)r[c] << 16);
    } else {
        const uint16_t *r = row;
        for (int64_t c = 0; c < k; c++) out[c] = f16_to_f32(r[c]);
    }
}

/* q = e4m3(x / s_j) over one row. The torch path's clamp to +-448 is left out: the cast above
 * saturates, so e4m3(clamp(v)) == e4m3(v) for every v (+-inf included, NaN kept), and for finite
 * input it never binds anyway (|w / s| <= 448 * (1 + 2^-23), which rounds to 448). Tests check
 * the cast against torch's over float32 bit patterns and the whole quantization bit for bit. */
INLINE void quantize_row(const float *x, const float *s, int64_t k, int64_t bk,
                                uint8_t *q) {
    for (int64_t j = 0, c0 = 0; c0 < k; j++, c0 += bk) {
        int64_t c1 = c0 + bk < k ? c0 + bk : k;
        float sj = s[j];
        for (int64_t c = c0; c < c1; c++) {
            q[c] = f32_to_e4m3(x[c] / sj);
        }
    }
}

/* w: contiguous [n, k] of `dtype` (RLTOOL_F32 / _BF16 / _F16); q: [n, k] e4m3fn bytes;
 * scale: [ceil(n/bn), ceil(k/bk)] fp32. Works one row of blocks at a time (two passes: the
 * block maxima, then divide + cast, one row converted to fp32 in an L1-sized scratch buffer).
 * Returns 0, or -1 for a bad dtype / block / failed allocation. */
RLTOOL_CLONES int rltool_fp8_quantize(const void *w, int dtype, int64_t n, int64_t k,
                                      int64_t bn, int64_t bk, uint8_t *q, float *scale) {
    if (bn < 1 || bk < 1 || n < 0 || k < 0) return -1;
    if (dtype != RLTOOL_F32 && dtype != RLTOOL_BF16 && dtype != RLTOOL_F16) return -1;
    size_t item = dtype == RLTOOL_F32 ? 4 : 2;
    int64_t nb = (n + bn - 1) / bn, kb = (k + bk - 1) / bk;
    uint32_t *amax = malloc((size_t)(kb > 0 ? kb : 1) * sizeof(uint32_t));
    float *x = malloc((size_t)(k > 0 ? k : 1) * sizeof(float));
    if (!amax || !x) {
        free(amax);
        free(x);
        return -1;
    }
    for (int64_t i = 0; i < nb; i++) {
        int64_t r0 = i * bn, r1 = r0 + bn < n ? r0 + bn : n;
        float *s = scale + i * kb;
        memset(amax, 0, (size_t)kb * sizeof(uint32_t));
        for (int64_t r = r0; r < r1; r++) {
            const void *row = (const char *)w + (size_t)(r * k) * item;
            if (item == 4) amax_row_u32(row, k, bk, amax);
            else amax_row_u16(row, k, bk, amax);
        }
        for (int64_t j = 0; j < kb; j++) {
            float a = abs_bits_to_f32(amax[j], dtype);
            s[j] = (a < 1e-12f ? 1e-12f : a) / 448.0f;  /* like torch's clamp_min: NaN stays */
        }
        for (int64_t r = r0; r < r1; r++) {
            row_to_f32((const char *)w + (size_t)(r * k) * item, dtype, k, x);
            quantize_row(x, s, k, bk, q + r * k);
        }
    }
    free(amax);
    free(x);
    return 0;
}

static float e4m3_table[256];

__attribute__((constructor)) static void init_e4m3_table(void) {
    for (int v = 0; v < 256; v++) e4m3_table[v] = e4m3_to_f32((uint8_t)v);
}

/* q: [n, k] e4m3fn bytes, scale_inv: [ceil(n/bn), ceil(k/bk)] fp32; out: [n, k] of out_dtype
 * (RLTOOL_F32 or RLTOOL_BF16). Returns 0, or -1 for a bad dtype / block. */
RLTOOL_CLONES int rltool_fp8_dequantize(const uint8_t *q, const float *scale_inv, int64_t n,
                                        int64_t k, int64_t bn, int64_t bk, int out_dtype,
                                        void *out) {
    if (bn < 1 || bk < 1 || n < 0 || k < 0) return -1;
    if (out_dtype != RLTOOL_F32 && out_dtype != RLTOOL_BF16) return -1;
    int64_t kb = (k + bk - 1) / bk;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *qrow = q + r * k;
        const float *s = scale_inv + (r / bn) * kb;
        for (int64_t j = 0; j < kb; j++) {
            int64_t c1 = (j + 1) * bk < k ? (j + 1) * bk : k;
            float sj = s[j];
            if (out_dtype == RLTOOL_F32) {
                float *o = (float *)out + r * k;
                for (int64_t c = j * bk; c < c1; c++) o[c] = e4m3_table[qrow[c]] * sj;
            } else {
                uint16_t *o = (uint16_t *)out + r * k;
                for (int64_t c = j * bk; c < c1; c++) o[c] = f32_to_bf16(e4m3_table[qrow[c]] * sj);
            }
        }
    }
    return 0;
}
