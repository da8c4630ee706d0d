/* rltool delta codec kernels (rltool/delta/codec.py): the per-chunk scans that numpy does in
 * several passes (compare, count, nonzero, gather, xor, cast, cumsum, scatter) done in one.
 *
 * Called through ctypes from rltool/delta/codec.py, which keeps a numpy implementation of every
 * function computing the same bytes (RLTOOL_NATIVE=0 selects it; tests compare both). Elements
 * are `width` bytes (1, 2, 4 or 8), little-endian, compared and XORed as raw bits. "Planes" are
 * byte-plane shuffled arrays: plane k holds byte k of every element, planes are `count` bytes
 * apart. Plain C, no Python C-API.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define RLTOOL_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define RLTOOL_CLONES
#endif

static inline uint64_t load_elem(const uint8_t *p, int32_t width) {
    uint64_t v = 0;
    memcpy(&v, p, (size_t)width); /* little-endian hosts only (checked by the caller) */
    return v;
}

/* Sparse encoding of old -> new over n elements: for each changed element i (ascending), its gap
 * to the previous changed element (i - prev - 1, prev starting at -1) goes to gaps[] and the
 * XOR old_i ^ new_i (width bytes) to xors[]. Returns the number of changed elements and the
 * largest gap in *max_gap, or -1 as soon as more than `cap` elements changed (the caller then
 * encodes the chunk densely). */
typedef struct {
    int64_t count, prev, cap;
    uint32_t top;
    uint32_t *gaps;
    uint8_t *xors;
} sparse_out;

/* Record element i (whose XOR e is nonzero); 0, or -1 when over capacity. */
static inline __attribute__((always_inline)) int emit(sparse_out *s, int64_t i, uint64_t e,
                                                      const int32_t width) {
    if (s->count == s->cap) return -1;
    uint32_t gap = (uint32_t)(i - s->prev - 1);
    s->gaps[s->count] = gap;
    if (gap > s->top) s->top = gap;
    memcpy(s->xors + s->count * width, &e, (size_t)width);
    s->count++;
    s->prev = i;
    return 0;
}

/* Elements [from, n) one at a time. */
static inline __attribute__((always_inline)) int scan_tail(sparse_out *s, const uint8_t *old,
                                                           const uint8_t *new_, int64_t from,
                                                           int64_t n, const int32_t width) {
    for (int64_t i = from; i < n; i++) {
        uint64_t e = load_elem(old + i * width, width) ^ load_elem(new_ + i * width, width);
        if (e && emit(s, i, e, width)) return -1;
    }
    return 0;
}

/* Portable scan: unchanged 8-byte words are skipped with one compare. */
static inline __attribute__((always_inline)) int scan_words(sparse_out *s, const uint8_t *old,
                                                            const uint8_t *new_, int64_t n,
                                                            const int32_t width) {
    const int64_t per_word = 8 / width, words = n / per_word;
    for (int64_t w = 0; w < words; w++) {
        uint64_t a, b;
        memcpy(&a, old + 8 * w, 8);
        memcpy(&b, new_ + 8 * w, 8);
        if (a == b) continue;
        if (scan_tail(s, old, new_, w * per_word, (w + 1) * per_word, width)) return -1;
    }
    return scan_tail(s, old, new_, words * per_word, n, width);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RLTOOL_HAVE_AVX2_SCAN 1
/* AVX2 scan: a 64-bit mask of the differing bytes of each 64-byte block, folded to one bit per
 * element, then one step per changed element (count trailing zeros, clear it): the work follows
 * the number of changes, not of elements. Elements never straddle a block (width divides 64).
 * The state lives in locals: stores through the uint8_t output may alias anything, so fields of
 * a struct would be reloaded after every one. */
static inline __attribute__((always_inline, target("avx2"))) int scan_avx2(
        sparse_out *s, const uint8_t *restrict old, const uint8_t *restrict new_, int64_t n,
        const int32_t width, const int shift) {
    const int64_t blocks = n * width / 64;
    const uint64_t starts = width == 1 ? ~0ull : width == 2 ? 0x5555555555555555ull
                          : width == 4 ? 0x1111111111111111ull : 0x0101010101010101ull;
    int64_t count = s->count, prev = s->prev;
    const int64_t cap = s->cap;
    uint32_t top = s->top;
    uint32_t *restrict gaps = s->gaps;
    uint8_t *restrict xors = s->xors;
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *a = old + 64 * k, *b = new_ + 64 * k;
        uint32_t lo = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(
            _mm256_loadu_si256((const __m256i *)a), _mm256_loadu_si256((const __m256i *)b)));
        uint32_t hi = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(
            _mm256_loadu_si256((const __m256i *)(a + 32)),
            _mm256_loadu_si256((const __m256i *)(b + 32))));
        uint64_t m = ~(((uint64_t)hi << 32) | lo);
        if (width >= 2) m |= m >> 1;
        if (width >= 4) m |= m >> 2;
        if (width >= 8) m |= m >> 4;
        m &= starts;
        while (m) {
            int t = __builtin_ctzll(m);
            m &= m - 1;
            if (count == cap) return -1;
            uint64_t e = load_elem(a + t, width) ^ load_elem(b + t, width);
            int64_t i = (64 * k + t) >> shift;
            uint32_t gap = (uint32_t)(i - prev - 1);
            gaps[count] = gap;
            top = gap > top ? gap : top;
            memcpy(xors + count * width, &e, (size_t)width);
            count++;
            prev = i;
        }
    }
    s->count = count;
    s->prev = prev;
    s->top = top;
    return scan_tail(s, old, new_, blocks * 64 / width, n, width);
}

__attribute__((target("avx2")))
static int scan_avx2_any(sparse_out *s, const uint8_t *old, const uint8_t *new_, int64_t n,
                         int32_t width) {
    switch (width) {
    case 1: return scan_avx2(s, old, new_, n, 1, 0);
    case 2: return scan_avx2(s, old, new_, n, 2, 1);
    case 4: return scan_avx2(s, old, new_, n, 4, 2);
    default: return scan_avx2(s, old, new_, n, 8, 3);
    }
}
#endif

int64_t rltool_delta_sparse_encode(const uint8_t *old, const uint8_t *new_, int64_t n,
                                   int32_t width, int64_t cap, uint32_t *gaps, uint8_t *xors,
                                   uint32_t *max_gap) {
    sparse_out s = {0, -1, cap, 0, gaps, xors};
    int rc;
#ifdef RLTOOL_HAVE_AVX2_SCAN
    if (__builtin_cpu_supports("avx2")) {
        rc = scan_avx2_any(&s, old, new_, n, width);
    } else
#endif
    switch (width) {
    case 1: rc = scan_words(&s, old, new_, n, 1); break;
    case 2: rc = scan_words(&s, old, new_, n, 2); break;
    case 4: rc = scan_words(&s, old, new_, n, 4); break;
    default: rc = scan_words(&s, old, new_, n, 8); break;
    }
    if (rc) return -1;
    *max_gap = s.top;
    return s.count;
}

/* Inverse of the sparse encoding, applied to the elements [first, end) of a chunk of n elements
 * (x points at element `first`; modified in place), reading gaps (gap_width bytes each) and XORs
 * (width bytes each) from their byte planes. Ranges must come in ascending order: state[0] is
 * the next entry, state[1] the position of the previous one (start with {0, -1}). Returns 0, or
 * -1 when a position runs past the chunk (a corrupt payload). Specialized per (width, gap_width)
 * so every access is a constant-size load. */
static inline __attribute__((always_inline)) int32_t sparse_apply(
        uint8_t *restrict x, int64_t first, int64_t end, int64_t n, const int32_t width,
        const uint8_t *restrict gap_planes, const int32_t gap_width,
        const uint8_t *restrict xor_planes, int64_t count, int64_t *state) {
    int64_t c = state[0], prev = state[1];
    int32_t rc = 0;
    for (; c < count; c++) {
        uint64_t gap = 0, v = 0;
        for (int32_t k = 0; k < gap_width; k++) gap |= (uint64_t)gap_planes[k * count + c] << (8 * k);
        int64_t pos = prev + (int64_t)gap + 1;
        if (pos >= n) { rc = -1; break; }
        if (pos >= end) break;
        for (int32_t k = 0; k < width; k++) v |= (uint64_t)xor_planes[k * count + c] << (8 * k);
        uint8_t *at = x + (pos - first) * width;
        uint64_t cur = load_elem(at, width) ^ v;
        memcpy(at, &cur, (size_t)width);
        prev = pos;
    }
    state[0] = c;
    state[1] = prev;
    return rc;
}

#define RLTOOL_APPLY_GAPS(W)                                                                   \
    switch (gap_width) {                                                                       \
    case 1: return sparse_apply(x, first, end, n, W, gap_planes, 1, xor_planes, count, state); \
    case 2: return sparse_apply(x, first, end, n, W, gap_planes, 2, xor_planes, count, state); \
    default: return sparse_apply(x, first, end, n, W, gap_planes, 4, xor_planes, count, state);\
    }

int32_t rltool_delta_sparse_apply(uint8_t *x, int64_t first, int64_t end, int64_t n, int32_t width,
                                  const uint8_t *gap_planes, int32_t gap_width,
                                  const uint8_t *xor_planes, int64_t count, int64_t *state) {
    if ((width != 1 && width != 2 && width != 4 && width != 8)
        || (gap_width != 1 && gap_width != 2 && gap_width != 4) || first > end || state[1] >= first)
        return -1;
    switch (width) {
    case 1: RLTOOL_APPLY_GAPS(1)
    case 2: RLTOOL_APPLY_GAPS(2)
    case 4: RLTOOL_APPLY_GAPS(4)
    default: RLTOOL_APPLY_GAPS(8)
    }
}

/* Dense encoding: the byte planes of old ^ new (n elements) into planes (n * width bytes).
 * Returns the number of changed elements. */
RLTOOL_CLONES
int64_t rltool_delta_xor_planes(const uint8_t *old, const uint8_t *new_, int64_t n, int32_t width,
                                uint8_t *planes) {
    int64_t changed = 0;
    if (width == 2) { /* the common case (bf16/fp16), written so gcc vectorizes it */
        for (int64_t i = 0; i < n; i++) {
            uint8_t lo = old[2 * i] ^ new_[2 * i], hi = old[2 * i + 1] ^ new_[2 * i + 1];
            planes[i] = lo;
            planes[n + i] = hi;
            changed += (lo | hi) != 0;
        }
        return changed;
    }
    for (int64_t i = 0; i < n; i++) {
        uint8_t any = 0;
        for (int32_t k = 0; k < width; k++) {
            uint8_t b = old[i * width + k] ^ new_[i * width + k];
            planes[k * n + i] = b;
            any |= b;
        }
        changed += any != 0;
    }
    return changed;
}

/* Inverse of the dense encoding on n elements x (in place): x ^= the elements held in byte
 * planes `stride` bytes apart (a range of a chunk's planes: pass its start and the chunk's n). */
RLTOOL_CLONES
void rltool_delta_xor_apply_planes(uint8_t *x, int64_t n, int32_t width, const uint8_t *planes,
                                   int64_t stride) {
    if (width == 2) {
        for (int64_t i = 0; i < n; i++) {
            x[2 * i] ^= planes[i];
            x[2 * i + 1] ^= planes[stride + i];
        }
        return;
    }
    for (int64_t i = 0; i < n; i++)
        for (int32_t k = 0; k < width; k++) x[i * width + k] ^= planes[k * stride + i];
}
