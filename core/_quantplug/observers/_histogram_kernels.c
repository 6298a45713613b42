/*
 * Native kernels for the histogram observers (optional; see quantplug/observers/kernels.py).
 *
 * A histogram observer's batch costs a min/max reduction and torch.histc's binning, and when
 * its range grows, torchao's re-binning of the old histogram. Done with torch operations that
 * is six to twenty kernels and several temporary tensors per batch, each operation dispatched
 * with cold caches right after a weight-heavy layer; these functions do the same work in one
 * call each, on raw float32 memory handed over by address.
 *
 * A histogram observer's batch within its current range (most batches) is one call, `observe`: the
 * min/max, the range check, the binning and the counts added to the histogram. Its first batch is
 * one call too, `start`: the min/max, the binning of that range, the counts and the range written. Where the CPU has
 * AVX2 (checked at import; GCC and Clang on x86) the min/max and the binning run on 8 lanes, and
 * the binning and the counting share one pass (bin_count_avx2), elsewhere on SSE2 or in scalar
 * code: the same operations, the same results.
 *
 * The range observers (minmax.py) take a batch's extremes into their state in one call, record_range,
 * and read a slice of a wider tensor (a q/k/v head) in place, minmax_rows.
 *
 * convert uses four more (row_extremes and quantize_rows for constants, search_norms for torchao's
 * histogram clipping search, quantization_errors for SeqMSE's candidates; described where they
 * are defined), and the algorithms' quantized simulation one, fake_quantize, for its activations.
 *
 * Exactness: the binning evaluates the same float32 expression as quantplug's LinearBinning
 * (itself torch.histc's arithmetic): (x - lo) [* scale] / divisor, clamped to the last bin,
 * truncated. IEEE float32 operations round the same whether vectorised or not; the build
 * disables floating-point contraction and fast-math. Counts are integers, so their order of
 * accumulation does not matter.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(_MSC_VER) && !defined(__clang__)
#define restrict __restrict /* MSVC's C mode spells it this way */
#endif

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define QP_SSE2 1
#endif

/* bins counted per sub-histogram on the stack; more bins use the heap */
#define STACK_BINS 4096
/* elements whose bin indices are computed before they are counted (without AVX2) */
#define CHUNK 512
/* independent sub-histograms, so that neighbouring equal bins do not serialise on one counter */
#define LANES 4

/* AVX2 variants, used where the CPU has AVX2 (compiled by GCC and Clang on x86; elsewhere the
 * SSE2 or scalar code runs): the same IEEE float32 operations on 8 lanes, the same results. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define QP_AVX2 1
#define QP_TARGET_AVX2 __attribute__((target("avx2")))
static int use_avx2 = 0;
#endif

/* min and max of x[i..n) folded into *mn and *mx; a NaN sets *nan */
static void minmax_tail(const float *x, int64_t i, int64_t n, float *mn, float *mx, int *nan) {
    for (; i < n; i++) {
        float v = x[i];
        *nan |= v != v;
        *mn = v < *mn ? v : *mn;
        *mx = v > *mx ? v : *mx;
    }
}

#ifdef QP_AVX2
/* folds x[0..i) into *mn, *mx, *nan and returns i (0 when n is too short to pay) */
QP_TARGET_AVX2 static int64_t minmax_avx2(const float *x, int64_t n, float *mn, float *mx, int *nan) {
    int64_t i = 0;
    if (n < 16) {
        return 0;
    }
    __m256 vmn = _mm256_set1_ps(INFINITY), vmx = _mm256_set1_ps(-INFINITY);
    __m256 vmn2 = vmn, vmx2 = vmx, vnan = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        vnan = _mm256_or_ps(vnan, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
        vmn = _mm256_min_ps(a, vmn);
        vmx = _mm256_max_ps(a, vmx);
        vmn2 = _mm256_min_ps(b, vmn2);
        vmx2 = _mm256_max_ps(b, vmx2);
    }
    float lo[8], hi[8];
    _mm256_storeu_ps(lo, _mm256_min_ps(vmn, vmn2));
    _mm256_storeu_ps(hi, _mm256_max_ps(vmx, vmx2));
    for (int k = 0; k < 8; k++) {
        *mn = lo[k] < *mn ? lo[k] : *mn;
        *mx = hi[k] > *mx ? hi[k] : *mx;
    }
    *nan |= _mm256_movemask_ps(vnan) != 0;
    return i;
}
#endif

/* min and max of x[0..n); a NaN anywhere makes both NaN */
static void minmax_f32(const float *x, int64_t n, float *out_min, float *out_max) {
    float mn = INFINITY, mx = -INFINITY;
    int64_t i = 0;
    int nan = 0;
#ifdef QP_AVX2
    if (use_avx2) {
        i = minmax_avx2(x, n, &mn, &mx, &nan);
    }
#endif
#ifdef QP_SSE2
    if (i == 0 && n >= 8) {
        __m128 vmn = _mm_set1_ps(INFINITY), vmx = _mm_set1_ps(-INFINITY);
        __m128 vmn2 = vmn, vmx2 = vmx, vnan = _mm_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
            vnan = _mm_or_ps(vnan, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
            vmn = _mm_min_ps(a, vmn);
            vmx = _mm_max_ps(a, vmx);
            vmn2 = _mm_min_ps(b, vmn2);
            vmx2 = _mm_max_ps(b, vmx2);
        }
        float lo[4], hi[4];
        _mm_storeu_ps(lo, _mm_min_ps(vmn, vmn2));
        _mm_storeu_ps(hi, _mm_max_ps(vmx, vmx2));
        for (int k = 0; k < 4; k++) {
            mn = lo[k] < mn ? lo[k] : mn;
            mx = hi[k] > mx ? hi[k] : mx;
        }
        nan = _mm_movemask_ps(vnan) != 0;
    }
#endif
    minmax_tail(x, i, n, &mn, &mx, &nan);
    if (nan) {
        mn = mx = NAN;
    }
    *out_min = mn;
    *out_max = mx;
}

/* min and max of `rows` rows of n contiguous values, `stride` apart; a NaN anywhere makes both NaN */
static void minmax_rows(const float *x, int64_t n, int64_t rows, int64_t stride, float *out_min, float *out_max) {
    minmax_f32(x, n, out_min, out_max);
    for (int64_t r = 1; r < rows; r++) {
        float mn, mx;
        minmax_f32(x + r * stride, n, &mn, &mx);
        if (mn != mn || *out_min != *out_min) {
            *out_min = *out_max = NAN;
            return;
        }
        *out_min = mn < *out_min ? mn : *out_min;
        *out_max = mx > *out_max ? mx : *out_max;
    }
}

/* The binning: a value's bin is (x - lo) [* scale] / divisor, clamped into [first, final] and
 * truncated; it is counted at offset bin - first. Clamped into [0, bins - 1] that is torch.histc's
 * bin (see binning.py). Every step is monotonic, so the bins of values within [v, w] lie between
 * the bins of v and w, and clamping into those instead changes no bin. */
typedef struct {
    float lo, scale, divisor, first, final;
} Binning;

static float bin_position(const Binning *g, float v) {
    float t = v - g->lo;
    if (g->scale != 0.0f) {
        t = t * g->scale;
    }
    t = t / g->divisor;
    t = t < g->final ? t : g->final; /* NaN: the last bin (memory safety only) */
    return t > g->first ? t : g->first;
}

static void bin_offsets_tail(const float *restrict x, int64_t i, int64_t m, const Binning *g,
                             int32_t *restrict idx) {
    const int32_t first = (int32_t)g->first;
    for (; i < m; i++) {
        idx[i] = (int32_t)bin_position(g, x[i]) - first;
    }
}

/* offsets (bin - first) of x[0..m) (in scalar code: with AVX2, bin_count_avx2 does both passes in one) */
static void bin_offsets(const float *restrict x, int64_t m, const Binning *g, int32_t *restrict idx) {
    bin_offsets_tail(x, 0, m, g, idx);
}

/* LANES sub-histograms of `width` uint32 counters each, zeroed: in `stack` (LANES * STACK_BINS
 * of them) when they fit, else on the heap (the caller frees what is not `stack`); NULL out of
 * memory */
static uint32_t *lane_counters(uint32_t *stack, int64_t width) {
    uint32_t *counts = stack;
    if (width > STACK_BINS) {
        counts = (uint32_t *)malloc(sizeof(uint32_t) * LANES * (size_t)width);
        if (counts == NULL) {
            return NULL;
        }
    }
    memset(counts, 0, sizeof(uint32_t) * LANES * (size_t)width);
    return counts;
}

/* counts the bin offsets idx[0..m) into lane_counters' sub-histograms, taking turns so that
 * neighbouring equal offsets do not serialise on one counter */
static void count_offsets(const int32_t *restrict idx, int64_t m, uint32_t *restrict counts, int64_t width) {
    uint32_t *c0 = counts, *c1 = c0 + width, *c2 = c1 + width, *c3 = c2 + width;
    int64_t i = 0;
    for (; i + LANES <= m; i += LANES) {
        c0[idx[i]]++;
        c1[idx[i + 1]]++;
        c2[idx[i + 2]]++;
        c3[idx[i + 3]]++;
    }
    for (; i < m; i++) {
        c0[idx[i]]++;
    }
}

#ifdef QP_AVX2
/* The 8 lanes' running min, max and NaN flag of the values bin_count_avx2 has read. */
typedef struct {
    __m256 mn, mx, nan;
} Lanes;

/* bin_offsets_tail's offsets of 8 values, folding them into the running min, max and NaN first */
QP_TARGET_AVX2 static inline __m256i offsets8(__m256 v, __m256 *mn, __m256 *mx, __m256 *nan, __m256 lo, __m256 scale,
                                              int scaled, __m256 divisor, __m256 first, __m256 final) {
    *nan = _mm256_or_ps(*nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    *mn = _mm256_min_ps(v, *mn);
    *mx = _mm256_max_ps(v, *mx);
    __m256 t = _mm256_sub_ps(v, lo);
    if (scaled) {
        t = _mm256_mul_ps(t, scale);
    }
    t = _mm256_div_ps(t, divisor);
    t = _mm256_max_ps(_mm256_min_ps(t, final), first); /* bin_position's operand order */
    /* t - first is exact (first is a whole number <= t < 2**24, so a multiple of t's ulp), so its
     * truncation is trunc(t) - first, bin_offsets_tail's offset, without a register for the latter */
    return _mm256_cvttps_epi32(_mm256_sub_ps(t, first));
}

/* counts 8 offsets, one to each sub-histogram in turn (on x86-64 read two to a 64-bit register,
 * not through memory) */
QP_TARGET_AVX2 static inline void count8(__m256i k, uint32_t *restrict c0, uint32_t *restrict c1,
                                         uint32_t *restrict c2, uint32_t *restrict c3) {
#if defined(__x86_64__)
    const __m128i low = _mm256_castsi256_si128(k), high = _mm256_extracti128_si256(k, 1);
    const uint64_t a = (uint64_t)_mm_cvtsi128_si64(low), b = (uint64_t)_mm_extract_epi64(low, 1);
    const uint64_t c = (uint64_t)_mm_cvtsi128_si64(high), d = (uint64_t)_mm_extract_epi64(high, 1);
    c0[(uint32_t)a]++;
    c1[a >> 32]++;
    c2[(uint32_t)b]++;
    c3[b >> 32]++;
    c0[(uint32_t)c]++;
    c1[c >> 32]++;
    c2[(uint32_t)d]++;
    c3[d >> 32]++;
#else
    int32_t idx[8];
    _mm256_storeu_si256((__m256i *)idx, k);
    c0[idx[0]]++;
    c1[idx[1]]++;
    c2[idx[2]]++;
    c3[idx[3]]++;
    c0[idx[4]]++;
    c1[idx[5]]++;
    c2[idx[6]]++;
    c3[idx[7]]++;
#endif
}

/*
 * bin_offsets and count_offsets of x[0..m) in one pass where the CPU has AVX2, folding the values
 * into *seen (their min, max and NaN on 8 lanes) and the last m % 8 of them into *mn, *mx and
 * *nan as minmax_tail does. Counting is bound by one scattered increment a cycle; the vector work
 * of 32 values at a time, done before their 32 increments and independent of them, runs under
 * that bound instead of in a pass of its own, and no offset goes through memory (the two-pass
 * kernels cost 0.38 ns a value on the bench's decoder-32 activations, this 0.32). The same offsets,
 * hence the same counts.
 */
QP_TARGET_AVX2 static void bin_count_avx2(const float *restrict x, int64_t m, const Binning *g,
                                          uint32_t *restrict counts, int64_t width, Lanes *seen, float *mn,
                                          float *mx, int *nan) {
    const __m256 lo = _mm256_set1_ps(g->lo), scale = _mm256_set1_ps(g->scale);
    const __m256 divisor = _mm256_set1_ps(g->divisor), first = _mm256_set1_ps(g->first);
    const __m256 final = _mm256_set1_ps(g->final);
    const int scaled = g->scale != 0.0f;
    uint32_t *c0 = counts, *c1 = c0 + width, *c2 = c1 + width, *c3 = c2 + width;
    /* in registers: the counters' stores might alias *seen */
    __m256 vmn = seen->mn, vmx = seen->mx, vnan = seen->nan;
    int64_t i = 0;
#define QP_OFFSETS8(at) offsets8(_mm256_loadu_ps(at), &vmn, &vmx, &vnan, lo, scale, scaled, divisor, first, final)
    for (; i + 32 <= m; i += 32) {
        const __m256i k0 = QP_OFFSETS8(x + i), k1 = QP_OFFSETS8(x + i + 8);
        const __m256i k2 = QP_OFFSETS8(x + i + 16), k3 = QP_OFFSETS8(x + i + 24);
        count8(k0, c0, c1, c2, c3);
        count8(k1, c0, c1, c2, c3);
        count8(k2, c0, c1, c2, c3);
        count8(k3, c0, c1, c2, c3);
    }
    for (; i + 8 <= m; i += 8) {
        count8(QP_OFFSETS8(x + i), c0, c1, c2, c3);
    }
#undef QP_OFFSETS8
    seen->mn = vmn;
    seen->mx = vmx;
    seen->nan = vnan;
    minmax_tail(x, i, m, mn, mx, nan);
    const int32_t base = (int32_t)g->first;
    for (; i < m; i++) {
        c0[(int32_t)bin_position(g, x[i]) - base]++;
    }
}

/* bin_count_avx2 of `rows` rows of n values, `stride` apart, whose extremes are known */
QP_TARGET_AVX2 static void count_rows_avx2(const float *x, int64_t n, int64_t rows, int64_t stride, const Binning *g,
                                           uint32_t *counts, int64_t width) {
    Lanes seen = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; /* not read */
    float mn = 0.0f, mx = 0.0f;
    int nan = 0;
    for (int64_t row = 0; row < rows; row++, x += stride) {
        bin_count_avx2(x, n, g, counts, width, &seen, &mn, &mx, &nan);
    }
}

/* *mn, *mx: the values' extremes, those of *seen folded in (NaN with a NaN anywhere) */
QP_TARGET_AVX2 static void fold_lanes(const Lanes *seen, float *mn, float *mx, int nan) {
    float lanes_mn[8], lanes_mx[8];
    _mm256_storeu_ps(lanes_mn, seen->mn);
    _mm256_storeu_ps(lanes_mx, seen->mx);
    for (int k = 0; k < 8; k++) {
        *mn = lanes_mn[k] < *mn ? lanes_mn[k] : *mn;
        *mx = lanes_mx[k] > *mx ? lanes_mx[k] : *mx;
    }
    if (nan || _mm256_movemask_ps(seen->nan) != 0) {
        *mn = *mx = NAN;
    }
}
#endif

/* out[b - from] (= or +=) the total of the sub-histograms' counters b in [from, to], as float32 */
static void lane_totals(const uint32_t *counts, int64_t width, int64_t from, int64_t to, float *out,
                        int accumulate) {
    const uint32_t *c0 = counts, *c1 = c0 + width, *c2 = c1 + width, *c3 = c2 + width;
    for (int64_t b = from; b <= to; b++) {
        /* exact: callers keep n below 2**24, so the sum fits an int32 and a float32 holds it */
        float total = (float)(int32_t)(c0[b] + c1[b] + c2[b] + c3[b]);
        out[b - from] = accumulate ? out[b - from] + total : total;
    }
}

/* out[b] (= or +=) the number of values in bin b, as float32, for `rows` rows of n contiguous
 * values `stride` apart, all within [mn, mx] (their extremes; NaN when not known): only the bins
 * between theirs are counted and summed, the rest are left (or set to 0). 0 on success, -1 out of
 * memory. */
static int bin_counts_f32(const float *x, int64_t n, int64_t rows, int64_t stride, float lo, float scale,
                          float divisor, int64_t bins, float mn, float mx, float *out, int accumulate) {
    Binning g = {lo, scale, divisor, 0.0f, (float)(bins - 1)};
    if (mn == mn && mx == mx) {
        const float first = bin_position(&g, mn), final = bin_position(&g, mx);
        g.first = (float)(int32_t)first;
        g.final = (float)(int32_t)final;
    }
    const int64_t first = (int64_t)g.first, width = (int64_t)g.final - first + 1;
    uint32_t stack_counts[LANES * STACK_BINS];
    uint32_t *counts = lane_counters(stack_counts, width);
    if (counts == NULL) {
        return -1;
    }
#ifdef QP_AVX2
    if (use_avx2) {
        count_rows_avx2(x, n, rows, stride, &g, counts, width);
    } else
#endif
    {
        int32_t idx[CHUNK];
        for (int64_t row = 0; row < rows; row++, x += stride) {
            for (int64_t start = 0; start < n; start += CHUNK) {
                int64_t m = n - start < CHUNK ? n - start : CHUNK;
                bin_offsets(x + start, m, &g, idx);
                count_offsets(idx, m, counts, width);
            }
        }
    }
    if (!accumulate) {
        memset(out, 0, sizeof(float) * (size_t)first);
        memset(out + first + width, 0, sizeof(float) * (size_t)(bins - first - width));
    }
    lane_totals(counts, width, 0, width - 1, out + first, accumulate);
    if (counts != stack_counts) {
        free(counts);
    }
    return 0;
}

#ifdef QP_AVX2
/*
 * observe's count where the CPU has AVX2: one sweep (bin_count_avx2) finds the bins (over the whole
 * range), counts them and finds the values' min, max and NaN together; the range is checked after it. 0: every value lay within
 * [check_lo, check_hi] and the counts were added to out; 1: not, out untouched; -1 out of memory.
 * *out_min and *out_max: the values' extremes (NaN with a NaN), as minmax_rows gives them.
 */
QP_TARGET_AVX2 static int observe_avx2(const float *x, int64_t n, int64_t rows, int64_t stride, float lo,
                                      float scale, float divisor, int64_t bins, float check_lo, float check_hi,
                                      float *out, float *out_min, float *out_max) {
    uint32_t stack_counts[LANES * STACK_BINS];
    uint32_t *counts = lane_counters(stack_counts, bins);
    if (counts == NULL) {
        return -1;
    }
    const Binning g = {lo, scale, divisor, 0.0f, (float)(bins - 1)};
    Lanes seen = {_mm256_set1_ps(INFINITY), _mm256_set1_ps(-INFINITY), _mm256_setzero_ps()};
    float mn = INFINITY, mx = -INFINITY;
    int nan = 0;
    for (int64_t row = 0; row < rows; row++, x += stride) {
        bin_count_avx2(x, n, &g, counts, bins, &seen, &mn, &mx, &nan);
    }
    fold_lanes(&seen, &mn, &mx, nan);
    *out_min = mn;
    *out_max = mx;
    int status = 1;
    if (mn >= check_lo && mx <= check_hi) {
        const int64_t first = (int64_t)bin_position(&g, mn), final = (int64_t)bin_position(&g, mx);
        lane_totals(counts, bins, first, final, out + first, 1);
        status = 0;
    }
    if (counts != stack_counts) {
        free(counts);
    }
    return status;
}
#endif

/* LinearBinning.make's operands (binning.py) for the bins over [lo, hi], two float32 values:
 * *scale (0: none) and *divisor, as the doubles it computes. 0 where it makes none: an empty
 * range, or one where (x - lo) * bins could overflow (an infinity among the values). */
static int linear_binning(double lo, double hi, int64_t bins, double *scale, double *divisor) {
    if (!(lo < hi) || -lo > (double)FLT_MAX || hi > (double)FLT_MAX || (hi - lo) * (double)bins > (double)FLT_MAX) {
        return 0;
    }
    const double span = (double)(float)(hi - lo); /* float32 subtraction, as in the kernel */
    if ((bins & (bins - 1)) == 0 && span / (double)bins >= (double)FLT_MIN) {
        *scale = 0.0;
        *divisor = span / (double)bins; /* exact: a power of two, and a normal float32 */
    } else {
        *scale = (double)bins;
        *divisor = span;
    }
    return 1;
}

/*
 * torchao's re-binning of a histogram onto a grown range: each old bin spread evenly over `rate`
 * sub-bins, whose mid-points `mids` fall into the new bins bounded by `edges` (bins + 1 values;
 * bucketize(right=True) - 1, clamped into the end bins), summed in sub-bin order in float32 as
 * torch.bincount(weights=...) does. out[b] = base[b] + sum (or the sum when base is NULL);
 * out may be hist. Returns 1 (writing nothing) unless mids and edges are sorted and NaN-free,
 * -1 out of memory, 0 done.
 */
static int rebin_f32(const float *hist, int64_t bins, int64_t rate, const float *mids, const float *edges,
                     const float *base, float *out) {
    if (edges[0] != edges[0]) {
        return 1;
    }
    for (int64_t b = 1; b <= bins; b++) {
        if (!(edges[b] >= edges[b - 1])) {
            return 1;
        }
    }
    float stack_sums[STACK_BINS];
    float *sums = stack_sums;
    if (bins > STACK_BINS) {
        sums = (float *)malloc(sizeof(float) * (size_t)bins);
        if (sums == NULL) {
            return -1;
        }
    }
    memset(sums, 0, sizeof(float) * (size_t)bins);
    const float divisor = (float)rate;
    float previous = -INFINITY;
    int64_t passed = 0; /* edges <= the current mid-point */
    int status = 0;
    for (int64_t b = 0; b < bins && status == 0; b++) {
        const float weight = hist[b] / divisor;
        for (int64_t k = 0; k < rate; k++) {
            const float mid = mids[b * rate + k];
            if (!(mid >= previous)) {
                status = 1;
                break;
            }
            previous = mid;
            while (passed <= bins && edges[passed] <= mid) {
                passed++;
            }
            int64_t bucket = passed - 1;
            bucket = bucket < 0 ? 0 : (bucket >= bins ? bins - 1 : bucket);
            sums[bucket] += weight;
        }
    }
    if (status == 0) {
        for (int64_t b = 0; b < bins; b++) {
            out[b] = base != NULL ? base[b] + sums[b] : sums[b];
        }
    }
    if (sums != stack_sums) {
        free(sums);
    }
    return status;
}

/*
 * Constants' min/max per row and their quantization (convert's weights).
 *
 * row_extremes: each row's min and max, as torch.amin/amax(dim=1) give them wherever they are
 * unique values: it stops (1) at a row whose min or max is NaN, infinite or zero (torch may
 * return either sign of a zero extreme), for the caller's torch path.
 *
 * quantize_rows: clamp(round(x * inv) + zp, lo, hi) stored as int8 or uint8, with torch's float32
 * steps: a float32 multiplication, rounding half to even (nearbyint; AVX's round_ps with
 * _MM_FROUND_TO_NEAREST_INT), a float32 addition of the zero point as float32, then max with lo and
 * min with hi; the clamped values are integers in the storage type's range, converted exactly. It
 * stops (1) at a NaN product, for the caller's torch path (torch's clamp keeps NaN).
 */
static int row_extremes(const float *x, int64_t rows, int64_t cols, float *out_min, float *out_max) {
    for (int64_t r = 0; r < rows; r++) {
        float mn, mx;
        minmax_f32(x + r * cols, cols, &mn, &mx);
        if (!(isfinite(mn) && isfinite(mx)) || mn == 0.0f || mx == 0.0f) {
            return 1;
        }
        out_min[r] = mn;
        out_max[r] = mx;
    }
    return 0;
}

typedef struct {
    float inv, zp, lo, hi;
} RowCode;

/* x[i..n) of one row; 1 at a NaN product */
static int quantize_tail(const float *x, int64_t i, int64_t n, RowCode c, void *out, int is_unsigned) {
    for (; i < n; i++) {
        float t = x[i] * c.inv;
        if (t != t) {
            return 1;
        }
        t = nearbyintf(t) + c.zp;
        t = t < c.lo ? c.lo : t;
        t = t > c.hi ? c.hi : t;
        if (is_unsigned) {
            ((uint8_t *)out)[i] = (uint8_t)t;
        } else {
            ((int8_t *)out)[i] = (int8_t)t;
        }
    }
    return 0;
}

#ifdef QP_AVX2
/* the first (n / 32) * 32 values of one row on 8 lanes; returns how many were done, -1 at a NaN */
QP_TARGET_AVX2 static int64_t quantize_avx2(const float *x, int64_t n, RowCode c, void *out, int is_unsigned) {
    const __m256 inv = _mm256_set1_ps(c.inv), zp = _mm256_set1_ps(c.zp);
    const __m256 lo = _mm256_set1_ps(c.lo), hi = _mm256_set1_ps(c.hi);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), inv);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(t, t, _CMP_UNORD_Q));
            t = _mm256_add_ps(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
            t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
            q[k] = _mm256_cvtps_epi32(t); /* an integer already: exact */
        }
        /* saturating packs of values already within range: the same values, lanes interleaved */
        __m256i words0 = _mm256_packs_epi32(q[0], q[1]), words1 = _mm256_packs_epi32(q[2], q[3]);
        __m256i bytes = is_unsigned ? _mm256_packus_epi16(words0, words1) : _mm256_packs_epi16(words0, words1);
        _mm256_storeu_si256((__m256i *)((int8_t *)out + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    return _mm256_movemask_ps(nan) ? -1 : i;
}
#endif

static int quantize_rows_f32(const float *x, int64_t rows, int64_t cols, const float *inv, int64_t inv_step,
                             const float *zp, int64_t zp_step, float lo, float hi, void *out, int is_unsigned) {
    for (int64_t r = 0; r < rows; r++) {
        RowCode c = {inv[r * inv_step], zp[r * zp_step], lo, hi};
        const float *row = x + r * cols;
        void *dst = (int8_t *)out + r * cols;
        int64_t i = 0;
#ifdef QP_AVX2
        if (use_avx2) {
            i = quantize_avx2(row, cols, c, dst, is_unsigned);
            if (i < 0) {
                return 1;
            }
        }
#endif
        if (quantize_tail(row, i, cols, c, dst, is_unsigned)) {
            return 1;
        }
    }
    return 0;
}

/*
 * quantization_errors: x - clamp(round(x / s), lo, hi) * s for rows of contiguous values, s one
 * per row (or one for all), in float32 or float64: torch's division, rounding half to even
 * (nearbyint; AVX's round with _MM_FROUND_TO_NEAREST_INT), clamp, multiplication and subtraction
 * in that dtype, one pass instead of five (SeqMSE's candidate errors, GroupCandidates.error).
 * lo and hi are integers, lo < 0 < hi: no clamped value is a zero whose sign could differ. A NaN
 * stays NaN as torch's clamp keeps it: the scalar comparisons are false for it, and AVX's
 * max(lo, t) and min(hi, t) return their second operand where one is NaN.
 */
#define QP_ERROR_TAIL(name, type, round)                                                             \
    static void name(const type *x, int64_t i, int64_t n, type s, type lo, type hi, type *out) {     \
        for (; i < n; i++) {                                                                         \
            type t = round(x[i] / s);                                                                \
            t = t < lo ? lo : t;                                                                     \
            t = t > hi ? hi : t;                                                                     \
            out[i] = x[i] - t * s;                                                                   \
        }                                                                                            \
    }
QP_ERROR_TAIL(error_tail_f32, float, nearbyintf)
QP_ERROR_TAIL(error_tail_f64, double, nearbyint)

#ifdef QP_AVX2
/* the first (n / lanes) * lanes values of one row; returns how many were done */
QP_TARGET_AVX2 static int64_t error_avx2_f32(const float *x, int64_t n, float s, float lo, float hi, float *out) {
    const __m256 vs = _mm256_set1_ps(s), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 t = _mm256_round_ps(_mm256_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_min_ps(vhi, _mm256_max_ps(vlo, t));
        _mm256_storeu_ps(out + i, _mm256_sub_ps(v, _mm256_mul_ps(t, vs)));
    }
    return i;
}

QP_TARGET_AVX2 static int64_t error_avx2_f64(const double *x, int64_t n, double s, double lo, double hi,
                                             double *out) {
    const __m256d vs = _mm256_set1_pd(s), vlo = _mm256_set1_pd(lo), vhi = _mm256_set1_pd(hi);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d v = _mm256_loadu_pd(x + i);
        __m256d t = _mm256_round_pd(_mm256_div_pd(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_min_pd(vhi, _mm256_max_pd(vlo, t));
        _mm256_storeu_pd(out + i, _mm256_sub_pd(v, _mm256_mul_pd(t, vs)));
    }
    return i;
}
#endif

static void quantization_errors_f32(const float *x, int64_t rows, int64_t cols, const float *scale, int64_t step,
                                    float lo, float hi, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float s = scale[r * step];
        int64_t i = 0;
#ifdef QP_AVX2
        if (use_avx2) {
            i = error_avx2_f32(x + r * cols, cols, s, lo, hi, out + r * cols);
        }
#endif
        error_tail_f32(x + r * cols, i, cols, s, lo, hi, out + r * cols);
    }
}

static void quantization_errors_f64(const double *x, int64_t rows, int64_t cols, const double *scale, int64_t step,
                                    double lo, double hi, double *out) {
    for (int64_t r = 0; r < rows; r++) {
        const double s = scale[r * step];
        int64_t i = 0;
#ifdef QP_AVX2
        if (use_avx2) {
            i = error_avx2_f64(x + r * cols, cols, s, lo, hi, out + r * cols);
        }
#endif
        error_tail_f64(x + r * cols, i, cols, s, lo, hi, out + r * cols);
    }
}

/*
 * fake_quantize: torch.fake_quantize_per_tensor_affine's values for a float32 tensor, as the
 * quantized simulation's torch path (sequential.fake_quantize_per_tensor) computes them, one IEEE
 * float32 operation at a time: t = x * inv (inv: the float32 1 / scale), rounded half to even,
 * + zp, max with lo, min with hi, - zp, * scale. One pass instead of that path's six; it stops
 * (1) where a product is NaN or not within (-EXACT_CODES, EXACT_CODES) (2^62), for the caller's
 * torch path (ATen's own kernel decides those).
 */
typedef struct {
    float inv, zp, lo, hi, scale;
} FakeCode;

#define FQ_EXACT 4611686018427387904.0f /* 2^62: sequential.EXACT_CODES */

static int fake_quantize_tail(const float *x, int64_t i, int64_t n, FakeCode c, float *out) {
    for (; i < n; i++) {
        float t = x[i] * c.inv;
        if (!(t > -FQ_EXACT && t < FQ_EXACT)) {
            return 1;
        }
        t = nearbyintf(t) + c.zp;
        t = t < c.lo ? c.lo : t;
        t = t > c.hi ? c.hi : t;
        out[i] = (t - c.zp) * c.scale;
    }
    return 0;
}

#ifdef QP_AVX2
/* the first (n / 8) * 8 values on 8 lanes; returns how many were done, -1 at a product beyond */
QP_TARGET_AVX2 static int64_t fake_quantize_avx2(const float *x, int64_t n, FakeCode c, float *out) {
    const __m256 inv = _mm256_set1_ps(c.inv), zp = _mm256_set1_ps(c.zp), scale = _mm256_set1_ps(c.scale);
    const __m256 lo = _mm256_set1_ps(c.lo), hi = _mm256_set1_ps(c.hi);
    const __m256 top = _mm256_set1_ps(FQ_EXACT), bottom = _mm256_set1_ps(-FQ_EXACT);
    __m256 inside = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + i), inv);
        /* ordered comparisons: false at NaN */
        inside = _mm256_and_ps(inside, _mm256_and_ps(_mm256_cmp_ps(t, top, _CMP_LT_OQ), _mm256_cmp_ps(t, bottom, _CMP_GT_OQ)));
        t = _mm256_add_ps(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
        /* max(t, lo) and min(., hi) as the scalar code's comparisons (no NaN gets here unflagged) */
        t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_sub_ps(t, zp), scale));
    }
    return _mm256_movemask_ps(inside) == 0xff ? i : -1;
}
#endif

static int fake_quantize_f32(const float *x, int64_t n, FakeCode c, float *out) {
    int64_t i = 0;
#ifdef QP_AVX2
    if (use_avx2) {
        i = fake_quantize_avx2(x, n, c, out);
        if (i < 0) {
            return 1;
        }
    }
#endif
    return fake_quantize_tail(x, i, n, c, out);
}

/*
 * search_norms: the per-bin terms of torchao's _compute_quantization_error for `rows` candidate
 * ranges (HistogramObserver's clipping search), each row the float32 operations the torch code in
 * torchao_observer_classes._Searches.errors applies, in its order, one IEEE operation at a time:
 *   begin = (i - start) * width; end = begin + width
 *   lower, upper = clamp(floor((double)begin or end / (double)dst), 0, top) as float32
 *   norm = ((half_cubed - (begin - (lower + 0.5) * dst)^3) / 3) * density + 0
 *   norm += (upper - lower - 1) * (density * whole_bin)
 *   norm += (((end - (upper * dst + half))^3 + half_cubed) / 3) * density
 * (cubes as (d * d) * d). The rows' sums are left to torch, which sums them in its own order.
 */
typedef struct {
    float start, width, dst, half, half_cubed, whole_bin;
    double dst64, top;
} NormRow;

static inline float floor_bin(float x, double dst64, double top) {
    double q = floor((double)x / dst64);
    if (q == q) { /* torch's clamp keeps NaN */
        q = q < 0.0 ? 0.0 : q;
        q = q > top ? top : q;
    }
    return (float)q;
}

#define NORM_ROW_BODY                                                                              \
    for (int64_t i = from; i < bins; i++) {                                                        \
        const float density = d[i];                                                                \
        float begin = (float)i - r.start;                                                          \
        begin = begin * r.width;                                                                   \
        const float end = begin + r.width;                                                         \
        const float lower = floor_bin(begin, r.dst64, r.top), upper = floor_bin(end, r.dst64, r.top); \
        float delta = lower + 0.5f;                                                                \
        delta = delta * r.dst;                                                                     \
        delta = begin - delta;                                                                     \
        float cube = delta * delta;                                                                \
        cube = cube * delta;                                                                       \
        float norm = r.half_cubed - cube;                                                          \
        norm = norm / 3.0f;                                                                        \
        norm = norm * density;                                                                     \
        norm = norm + 0.0f;                                                                        \
        float count = upper - lower;                                                               \
        count = count - 1.0f;                                                                      \
        count = count * (density * r.whole_bin);                                                   \
        norm = norm + count;                                                                       \
        float far = upper * r.dst;                                                                 \
        far = far + r.half;                                                                        \
        far = end - far;                                                                           \
        float cube2 = far * far;                                                                   \
        cube2 = cube2 * far;                                                                       \
        cube2 = cube2 + r.half_cubed;                                                              \
        cube2 = cube2 / 3.0f;                                                                      \
        cube2 = cube2 * density;                                                                   \
        out[i] = norm + cube2;                                                                     \
    }

/* bins [from, bins) of one row */
static void norm_row(const float *restrict d, int64_t from, int64_t bins, NormRow r, float *restrict out) {
    NORM_ROW_BODY
}

#ifdef QP_AVX2
/* floor_bin of 8 values: two halves in float64 (torch's clamp keeps NaN: max/min return their
 * second operand, q, when it is NaN) */
QP_TARGET_AVX2 static inline __m256 floor_bins_avx2(__m256 x, __m256d dst64, __m256d top) {
    const __m256d zero = _mm256_setzero_pd();
    __m256d a = _mm256_floor_pd(_mm256_div_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), dst64));
    __m256d b = _mm256_floor_pd(_mm256_div_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), dst64));
    a = _mm256_min_pd(top, _mm256_max_pd(zero, a));
    b = _mm256_min_pd(top, _mm256_max_pd(zero, b));
    return _mm256_set_m128(_mm256_cvtpd_ps(b), _mm256_cvtpd_ps(a));
}

/* NORM_ROW_BODY on 8 bins at a time (the same operations), the tail in scalar code */
QP_TARGET_AVX2 static void norm_row_avx2(const float *restrict d, int64_t bins, NormRow r, float *restrict out) {
    const __m256 start = _mm256_set1_ps(r.start), width = _mm256_set1_ps(r.width), dst = _mm256_set1_ps(r.dst);
    const __m256 half = _mm256_set1_ps(r.half), half_cubed = _mm256_set1_ps(r.half_cubed);
    const __m256 whole_bin = _mm256_set1_ps(r.whole_bin), three = _mm256_set1_ps(3.0f);
    const __m256 point_five = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256d dst64 = _mm256_set1_pd(r.dst64), top = _mm256_set1_pd(r.top);
    const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t i = 0;
    for (; i + 8 <= bins; i += 8) {
        const __m256 density = _mm256_loadu_ps(d + i);
        const __m256 index = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_set1_epi32((int32_t)i), step));
        const __m256 begin = _mm256_mul_ps(_mm256_sub_ps(index, start), width);
        const __m256 end = _mm256_add_ps(begin, width);
        const __m256 lower = floor_bins_avx2(begin, dst64, top), upper = floor_bins_avx2(end, dst64, top);
        __m256 delta = _mm256_sub_ps(begin, _mm256_mul_ps(_mm256_add_ps(lower, point_five), dst));
        __m256 cube = _mm256_mul_ps(_mm256_mul_ps(delta, delta), delta);
        __m256 norm = _mm256_mul_ps(_mm256_div_ps(_mm256_sub_ps(half_cubed, cube), three), density);
        norm = _mm256_add_ps(norm, zero);
        __m256 count = _mm256_sub_ps(_mm256_sub_ps(upper, lower), one);
        norm = _mm256_add_ps(norm, _mm256_mul_ps(count, _mm256_mul_ps(density, whole_bin)));
        delta = _mm256_sub_ps(end, _mm256_add_ps(_mm256_mul_ps(upper, dst), half));
        cube = _mm256_mul_ps(_mm256_mul_ps(delta, delta), delta);
        norm = _mm256_add_ps(norm, _mm256_mul_ps(_mm256_div_ps(_mm256_add_ps(cube, half_cubed), three), density));
        _mm256_storeu_ps(out + i, norm);
    }
    norm_row(d, i, bins, r, out);
}
#endif

static int as_address(PyObject *obj, void **out) {
    *out = PyLong_AsVoidPtr(obj);
    return *out == NULL && PyErr_Occurred() ? -1 : 0;
}

/* -1 with a TypeError naming the call unless nargs is as expected */
static int check_count(Py_ssize_t nargs, Py_ssize_t expected, const char *signature) {
    if (nargs == expected) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", signature, expected);
    return -1;
}

PyDoc_STRVAR(minmax_doc,
             "minmax(address, n) -> (min, max) of n contiguous float32 values; (nan, nan) if any is NaN.");

static PyObject *minmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 2, "minmax(address, n)") < 0) {
        return NULL;
    }
    void *x;
    if (as_address(args[0], &x) < 0) {
        return NULL;
    }
    int64_t n = PyLong_AsLongLong(args[1]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n <= 0 || x == NULL) {
        PyErr_SetString(PyExc_ValueError, "minmax needs a non-null address and n > 0");
        return NULL;
    }
    float mn, mx;
    Py_BEGIN_ALLOW_THREADS
    minmax_f32((const float *)x, n, &mn, &mx);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(dd)", (double)mn, (double)mx);
}

PyDoc_STRVAR(minmax_rows_doc,
             "minmax_rows(address, n, rows, stride) -> (min, max) of `rows` rows of n contiguous float32\n"
             "values, `stride` values apart (a slice of a wider tensor, read in place); (nan, nan) if any\n"
             "is NaN.");

static PyObject *minmax_rows_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 4, "minmax_rows(address, n, rows, stride)") < 0) {
        return NULL;
    }
    void *x;
    if (as_address(args[0], &x) < 0) {
        return NULL;
    }
    const int64_t n = PyLong_AsLongLong(args[1]);
    const int64_t rows = PyLong_AsLongLong(args[2]);
    const int64_t stride = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (n <= 0 || rows <= 0 || x == NULL || (rows > 1 && stride < n) || rows > INT64_MAX / (stride > 0 ? stride : 1)) {
        PyErr_SetString(PyExc_ValueError, "minmax_rows needs a non-null address, n > 0, rows > 0 and stride >= n");
        return NULL;
    }
    float mn, mx;
    Py_BEGIN_ALLOW_THREADS
    minmax_rows((const float *)x, n, rows, stride, &mn, &mx);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(dd)", (double)mn, (double)mx);
}

PyDoc_STRVAR(record_range_doc,
             "record_range(lo, hi, average, c, min_address, max_address, batches_address) -> None\n\n"
             "A range observer's batch with extremes lo, hi taken into its float32 min and max and its int64\n"
             "count of batches (0-dim buffers at the addresses), as MinMaxObserver._update_views (average\n"
             "false: min(min, lo), max(max, hi)) or MovingAverageMinMaxObserver._update_views (average true:\n"
             "lo, hi on the first batch, else min + (lo - min) * c in float32 arithmetic, c rounded to\n"
             "float32) write it; then adds 1 to the count.");

/* current + (value - current) * c in float32 operations (no contraction: the build disables it), the
 * roundings of torch's 0-dim float32 arithmetic and of minmax.py's _average_step */
static float average_step(float current, float value, float c) {
    const float difference = value - current;
    const float step = difference * c;
    return current + step;
}

static PyObject *record_range(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 7, "record_range(lo, hi, average, c, min_address, max_address, batches_address)") < 0) {
        return NULL;
    }
    void *lo_at, *hi_at, *batches;
    if (as_address(args[4], &lo_at) < 0 || as_address(args[5], &hi_at) < 0 || as_address(args[6], &batches) < 0) {
        return NULL;
    }
    const double lo = PyFloat_AsDouble(args[0]);
    const double hi = PyFloat_AsDouble(args[1]);
    const int average = PyObject_IsTrue(args[2]);
    const double c = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred() || average < 0) {
        return NULL;
    }
    if (lo_at == NULL || hi_at == NULL || batches == NULL) {
        PyErr_SetString(PyExc_ValueError, "record_range needs non-null addresses");
        return NULL;
    }
    float *const mn = (float *)lo_at, *const mx = (float *)hi_at;
    int64_t *const count = (int64_t *)batches;
    if (!average) {
        /* compared as doubles, stored rounded to float32: as the ctypes views compare and store */
        if (lo < (double)*mn) {
            *mn = (float)lo;
        }
        if (hi > (double)*mx) {
            *mx = (float)hi;
        }
    } else if (*count == 0) {
        *mn = (float)lo;
        *mx = (float)hi;
    } else {
        const float cf = (float)c; /* minmax.float32: the same rounding, infinite beyond the range */
        const float new_mn = average_step(*mn, (float)lo, cf);
        const float new_mx = average_step(*mx, (float)hi, cf);
        *mn = new_mn;
        *mx = new_mx;
    }
    *count += 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(bin_counts_doc,
             "bin_counts(address, n, lo, scale, divisor, bins, out_address, accumulate) -> None\n\n"
             "Counts n contiguous float32 values into bins float32 counters at out_address (set them,\n"
             "or add to them if accumulate): bin = int(min((x - lo) [* scale] / divisor, bins - 1)),\n"
             "all in float32; a scale of 0 means none. The values must lie in [lo, hi].\n"
             "bin_counts(..., accumulate, min, max): the same, given the values' min and max.");

static PyObject *bin_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10 &&
        check_count(nargs, 8, "bin_counts(address, n, lo, scale, divisor, bins, out_address, accumulate)") < 0) {
        return NULL;
    }
    void *x, *out;
    if (as_address(args[0], &x) < 0 || as_address(args[6], &out) < 0) {
        return NULL;
    }
    int64_t n = PyLong_AsLongLong(args[1]);
    double lo = PyFloat_AsDouble(args[2]);
    double scale = PyFloat_AsDouble(args[3]);
    double divisor = PyFloat_AsDouble(args[4]);
    int64_t bins = PyLong_AsLongLong(args[5]);
    int accumulate = PyObject_IsTrue(args[7]);
    const int known = nargs == 10;
    double given_min = known ? PyFloat_AsDouble(args[8]) : 0.0;
    double given_max = known ? PyFloat_AsDouble(args[9]) : 0.0;
    if (PyErr_Occurred() || accumulate < 0) {
        return NULL;
    }
    if (n <= 0 || n >= (1 << 24) || bins <= 0 || bins > (1 << 24) || x == NULL || out == NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "bin_counts needs non-null addresses, 0 < n < 2**24 and 0 < bins <= 2**24");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    float mn = (float)given_min, mx = (float)given_max;
    if (!known) {
        minmax_f32((const float *)x, n, &mn, &mx);
    }
    status = bin_counts_f32((const float *)x, n, 1, 0, (float)lo, (float)scale, (float)divisor, bins, mn, mx,
                            (float *)out, accumulate);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(observe_doc,
             "observe(address, n, rows, stride, lo, hi, scale, divisor, bins, hist_address, min_address,\n"
             "        max_address, batches_address) -> None or (min, max)\n\n"
             "A histogram observer's batch of float32 values (rows of n contiguous values, stride apart)\n"
             "when its range holds them: if\n"
             "the float32 range at min_address and max_address is [lo, hi] and every value lies in it,\n"
             "adds their counts (bin_counts' binning) to the bins float32 counters at hist_address and 1\n"
             "to the int64 at batches_address, and returns None. Otherwise writes nothing and returns the\n"
             "values' (min, max), as minmax does.");

static PyObject *observe(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 13,
                    "observe(address, n, rows, stride, lo, hi, scale, divisor, bins, hist_address, "
                    "min_address, max_address, batches_address)") < 0) {
        return NULL;
    }
    void *x, *hist, *lo_at, *hi_at, *batches;
    if (as_address(args[0], &x) < 0 || as_address(args[9], &hist) < 0 || as_address(args[10], &lo_at) < 0 ||
        as_address(args[11], &hi_at) < 0 || as_address(args[12], &batches) < 0) {
        return NULL;
    }
    int64_t n = PyLong_AsLongLong(args[1]);
    int64_t rows = PyLong_AsLongLong(args[2]);
    int64_t stride = PyLong_AsLongLong(args[3]);
    double lo = PyFloat_AsDouble(args[4]);
    double hi = PyFloat_AsDouble(args[5]);
    double scale = PyFloat_AsDouble(args[6]);
    double divisor = PyFloat_AsDouble(args[7]);
    int64_t bins = PyLong_AsLongLong(args[8]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (n <= 0 || rows <= 0 || n >= (1 << 24) || rows >= (1 << 24) / n || (rows > 1 && stride < n) ||
        bins <= 0 || bins > (1 << 24) || x == NULL || hist == NULL || lo_at == NULL || hi_at == NULL ||
        batches == NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "observe needs non-null addresses, 0 < n * rows < 2**24, stride >= n (rows apart) and "
                        "0 < bins <= 2**24");
        return NULL;
    }
    const float lo_f = (float)lo, hi_f = (float)hi;
    float mn, mx;
    int status = 1; /* 1: not counted */
    Py_BEGIN_ALLOW_THREADS
#ifdef QP_AVX2
    if (use_avx2 && *(const float *)lo_at == lo_f && *(const float *)hi_at == hi_f) {
        status = observe_avx2((const float *)x, n, rows, stride, lo_f, (float)scale, (float)divisor, bins, lo_f, hi_f,
                              (float *)hist, &mn, &mx);
    } else
#endif
    {
        minmax_rows((const float *)x, n, rows, stride, &mn, &mx);
        if (*(const float *)lo_at == lo_f && *(const float *)hi_at == hi_f && mn >= lo_f && mx <= hi_f) {
            status = bin_counts_f32((const float *)x, n, rows, stride, lo_f, (float)scale, (float)divisor, bins,
                                    mn, mx, (float *)hist, 1);
        }
    }
    if (status == 0) {
        *(int64_t *)batches += 1;
    }
    Py_END_ALLOW_THREADS
    if (status < 0) {
        return PyErr_NoMemory();
    }
    if (status == 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(dd)", (double)mn, (double)mx);
}

PyDoc_STRVAR(start_doc,
             "start(address, n, bins, floor, hist_address, min_address, max_address, batches_address)\n"
             "    -> (lo, hi, scale, divisor, bins) or (min, max)\n\n"
             "A histogram observer's first batch of n contiguous float32 values in one call: their min and\n"
             "max [lo, hi] (minmax's), then, where the float32 range at min_address and max_address holds\n"
             "none yet (min > max), neither extreme is zero, lo > floor and LinearBinning.make makes a\n"
             "binning of [lo, hi] (finite, lo < hi): their counts written (not added) to the bins float32\n"
             "counters at hist_address (bin_counts' binning), the range set to [lo, hi] and 1 added to the\n"
             "int64 at batches_address; returns the binning's (lo, hi, scale, divisor, bins), as\n"
             "LinearBinning.make computes them. Otherwise writes nothing and returns (min, max).");

static PyObject *start(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 8,
                    "start(address, n, bins, floor, hist_address, min_address, max_address, batches_address)") <
        0) {
        return NULL;
    }
    void *x, *hist, *lo_at, *hi_at, *batches;
    if (as_address(args[0], &x) < 0 || as_address(args[4], &hist) < 0 || as_address(args[5], &lo_at) < 0 ||
        as_address(args[6], &hi_at) < 0 || as_address(args[7], &batches) < 0) {
        return NULL;
    }
    int64_t n = PyLong_AsLongLong(args[1]);
    int64_t bins = PyLong_AsLongLong(args[2]);
    double floor_ = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (n <= 0 || n >= (1 << 24) || bins <= 0 || bins > (1 << 24) || x == NULL || hist == NULL || lo_at == NULL ||
        hi_at == NULL || batches == NULL) {
        PyErr_SetString(PyExc_ValueError, "start needs non-null addresses, 0 < n < 2**24 and 0 < bins <= 2**24");
        return NULL;
    }
    float mn, mx;
    double scale = 0.0, divisor = 0.0;
    int status = 1; /* 1: not counted */
    Py_BEGIN_ALLOW_THREADS
    minmax_f32((const float *)x, n, &mn, &mx);
    if (mn != 0.0f && mx != 0.0f && (double)mn > floor_ && *(const float *)lo_at > *(const float *)hi_at &&
        linear_binning(mn, mx, bins, &scale, &divisor)) {
        status = bin_counts_f32((const float *)x, n, 1, 0, mn, (float)scale, (float)divisor, bins, mn, mx,
                                (float *)hist, 0);
        if (status == 0) {
            *(float *)lo_at = mn;
            *(float *)hi_at = mx;
            *(int64_t *)batches += 1;
        }
    }
    Py_END_ALLOW_THREADS
    if (status < 0) {
        return PyErr_NoMemory();
    }
    if (status == 0) {
        return Py_BuildValue("(ddddL)", (double)mn, (double)mx, scale, divisor, (long long)bins);
    }
    return Py_BuildValue("(dd)", (double)mn, (double)mx);
}

PyDoc_STRVAR(row_extremes_doc,
             "row_extremes(address, rows, cols, min_address, max_address) -> bool\n\n"
             "Each of `rows` rows of `cols` contiguous float32 values: its min and max written to the float32\n"
             "arrays at min_address and max_address. False (stopped, the arrays partly written) at a row\n"
             "whose min or max is NaN, infinite or zero.");

static PyObject *row_extremes_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 5, "row_extremes(address, rows, cols, min_address, max_address)") < 0) {
        return NULL;
    }
    void *x, *mn, *mx;
    if (as_address(args[0], &x) < 0 || as_address(args[3], &mn) < 0 || as_address(args[4], &mx) < 0) {
        return NULL;
    }
    int64_t rows = PyLong_AsLongLong(args[1]);
    int64_t cols = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (rows <= 0 || cols <= 0 || x == NULL || mn == NULL || mx == NULL) {
        PyErr_SetString(PyExc_ValueError, "row_extremes needs non-null addresses, rows > 0 and cols > 0");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = row_extremes((const float *)x, rows, cols, (float *)mn, (float *)mx);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(status == 0);
}

PyDoc_STRVAR(quantize_rows_doc,
             "quantize_rows(address, rows, cols, inv_address, inv_step, zp_address, zp_step, lo, hi,\n"
             "              out_address, unsigned) -> bool\n\n"
             "Row r of `rows` rows of `cols` contiguous float32 values quantized into the int8 (uint8 if\n"
             "unsigned) array at out_address: clamp(round(x * inv) + zp, lo, hi) in float32, rounding half\n"
             "to even, with inv and zp the float32 values at inv_address[r * inv_step] and\n"
             "zp_address[r * zp_step]. lo and hi must be integers within the storage type's range.\n"
             "False (stopped, out partly written) at a NaN product.");

static PyObject *quantize_rows_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 11,
                    "quantize_rows(address, rows, cols, inv_address, inv_step, zp_address, zp_step, lo, hi, "
                    "out_address, unsigned)") < 0) {
        return NULL;
    }
    void *x, *inv, *zp, *out;
    if (as_address(args[0], &x) < 0 || as_address(args[3], &inv) < 0 || as_address(args[5], &zp) < 0 ||
        as_address(args[9], &out) < 0) {
        return NULL;
    }
    int64_t rows = PyLong_AsLongLong(args[1]);
    int64_t cols = PyLong_AsLongLong(args[2]);
    int64_t inv_step = PyLong_AsLongLong(args[4]);
    int64_t zp_step = PyLong_AsLongLong(args[6]);
    int64_t lo = PyLong_AsLongLong(args[7]);
    int64_t hi = PyLong_AsLongLong(args[8]);
    int is_unsigned = PyObject_IsTrue(args[10]);
    if (PyErr_Occurred() || is_unsigned < 0) {
        return NULL;
    }
    const int64_t floor = is_unsigned ? 0 : -128, ceiling = is_unsigned ? 255 : 127;
    if (rows <= 0 || cols <= 0 || x == NULL || inv == NULL || zp == NULL || out == NULL || (inv_step != 0 && inv_step != 1) ||
        (zp_step != 0 && zp_step != 1) || lo < floor || hi > ceiling || lo > hi) {
        PyErr_SetString(PyExc_ValueError,
                        "quantize_rows needs non-null addresses, rows > 0, cols > 0, steps of 0 or 1 and "
                        "lo <= hi within the storage type's range");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = quantize_rows_f32((const float *)x, rows, cols, (const float *)inv, inv_step, (const float *)zp, zp_step,
                               (float)lo, (float)hi, out, is_unsigned);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(status == 0);
}

PyDoc_STRVAR(quantization_errors_doc,
             "quantization_errors(address, rows, cols, scale_address, scale_step, lo, hi, out_address,\n"
             "                    double) -> None\n\n"
             "Row r of `rows` rows of `cols` contiguous float32 (float64 if double) values at address:\n"
             "x - clamp(round(x / s), lo, hi) * s into the array of the same dtype at out_address, with s\n"
             "the value at scale_address[r * scale_step] (a step of 0 or 1), rounding half to even, each\n"
             "operation in that dtype. lo and hi: integers with lo < 0 < hi.");

static PyObject *quantization_errors_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 9,
                    "quantization_errors(address, rows, cols, scale_address, scale_step, lo, hi, out_address, "
                    "double)") < 0) {
        return NULL;
    }
    void *x, *scale, *out;
    if (as_address(args[0], &x) < 0 || as_address(args[3], &scale) < 0 || as_address(args[7], &out) < 0) {
        return NULL;
    }
    int64_t rows = PyLong_AsLongLong(args[1]);
    int64_t cols = PyLong_AsLongLong(args[2]);
    int64_t step = PyLong_AsLongLong(args[4]);
    int64_t lo = PyLong_AsLongLong(args[5]);
    int64_t hi = PyLong_AsLongLong(args[6]);
    int is_double = PyObject_IsTrue(args[8]);
    if (PyErr_Occurred() || is_double < 0) {
        return NULL;
    }
    if (rows <= 0 || cols <= 0 || x == NULL || scale == NULL || out == NULL || (step != 0 && step != 1) || lo >= 0 ||
        hi <= 0 || lo < -(1LL << 24) || hi > (1LL << 24)) {
        PyErr_SetString(PyExc_ValueError,
                        "quantization_errors needs non-null addresses, rows > 0, cols > 0, a step of 0 or 1 and "
                        "-2**24 <= lo < 0 < hi <= 2**24");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (is_double) {
        quantization_errors_f64((const double *)x, rows, cols, (const double *)scale, step, (double)lo, (double)hi,
                                (double *)out);
    } else {
        quantization_errors_f32((const float *)x, rows, cols, (const float *)scale, step, (float)lo, (float)hi,
                                (float *)out);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(fake_quantize_doc,
             "fake_quantize(address, n, inv, scale, zero_point, lo, hi, out_address) -> bool\n\n"
             "n contiguous float32 values fake-quantized per tensor into the float32 array at out_address\n"
             "(see the C source): True, or False (stopped, out partly written) where a product x * inv is\n"
             "NaN or beyond 2**62. inv and scale are taken as float32 (as torch takes a scalar\n"
             "operand of a float32 operation); zero_point, lo and hi integers within\n"
             "2**24 in magnitude.");

static PyObject *fake_quantize_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 8, "fake_quantize(address, n, inv, scale, zero_point, lo, hi, out_address)") < 0) {
        return NULL;
    }
    void *x, *out;
    if (as_address(args[0], &x) < 0 || as_address(args[7], &out) < 0) {
        return NULL;
    }
    int64_t n = PyLong_AsLongLong(args[1]);
    double inv = PyFloat_AsDouble(args[2]);
    double scale = PyFloat_AsDouble(args[3]);
    int64_t zp = PyLong_AsLongLong(args[4]);
    int64_t lo = PyLong_AsLongLong(args[5]);
    int64_t hi = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    const int64_t limit = (int64_t)1 << 24;
    if (n <= 0 || x == NULL || out == NULL || lo > hi || zp <= -limit || zp >= limit || lo <= -limit ||
        hi >= limit) {
        PyErr_SetString(PyExc_ValueError,
                        "fake_quantize needs non-null addresses, n > 0, and lo <= hi and "
                        "zero_point within 2**24 in magnitude");
        return NULL;
    }
    FakeCode c = {(float)inv, (float)zp, (float)lo, (float)hi, (float)scale};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fake_quantize_f32((const float *)x, n, c, (float *)out);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(status == 0);
}

PyDoc_STRVAR(search_norms_doc,
             "search_norms(bins, rows, density_address, owner_address, start_address, width_address,\n"
             "             dst_address, half_address, half_cubed_address, whole_bin_address, top, out_address)"
             " -> None\n\n"
             "The per-bin quantization-error terms of `rows` candidate ranges of torchao's histogram\n"
             "clipping search into the float32 [rows, bins] array at out_address (see the C source).\n"
             "density: float32 [observers, bins]; width: float32 [observers]; owner: int64 [rows], each\n"
             "row's observer (0: all the first); start, dst, half, half_cubed, whole_bin: float32 [rows];\n"
             "top: the last\n"
             "destination bin.");

static PyObject *search_norms(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 12,
                    "search_norms(bins, rows, density_address, owner_address, start_address, width_address, "
                    "dst_address, half_address, half_cubed_address, whole_bin_address, top, out_address)") < 0) {
        return NULL;
    }
    void *density, *owner, *start, *width, *dst, *half, *half_cubed, *whole_bin, *out;
    if (as_address(args[2], &density) < 0 || as_address(args[3], &owner) < 0 || as_address(args[4], &start) < 0 ||
        as_address(args[5], &width) < 0 || as_address(args[6], &dst) < 0 || as_address(args[7], &half) < 0 ||
        as_address(args[8], &half_cubed) < 0 || as_address(args[9], &whole_bin) < 0 ||
        as_address(args[11], &out) < 0) {
        return NULL;
    }
    int64_t bins = PyLong_AsLongLong(args[0]);
    int64_t rows = PyLong_AsLongLong(args[1]);
    int64_t top = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (bins <= 0 || rows <= 0 || top < 0 || density == NULL || start == NULL || width == NULL || dst == NULL ||
        half == NULL || half_cubed == NULL || whole_bin == NULL || out == NULL) {
        PyErr_SetString(PyExc_ValueError, "search_norms needs non-null addresses (but owner), bins > 0, rows > 0, top >= 0");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t k = 0; k < rows; k++) {
        const float *f = (const float *)dst;
        const int64_t observer = owner == NULL ? 0 : ((const int64_t *)owner)[k];
        NormRow r = {((const float *)start)[k], ((const float *)width)[observer], f[k], ((const float *)half)[k],
                     ((const float *)half_cubed)[k], ((const float *)whole_bin)[k], (double)f[k], (double)top};
        const float *d = (const float *)density + observer * bins;
        float *o = (float *)out + k * bins;
#ifdef QP_AVX2
        if (use_avx2) {
            norm_row_avx2(d, bins, r, o);
            continue;
        }
#endif
        norm_row(d, 0, bins, r, o);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(search_walk_doc,
             "search_walk(c_sum_address, bins, total, alpha, beta, start_bin, end_bin, n, max_steps)\n"
             "    -> [(alpha, beta, start_bin, end_bin), ...]\n\n"
             "The next n candidate ranges of torchao's _non_linear_param_search bin walk (fewer once\n"
             "max_steps steps found none after the first), from the state (alpha, beta, start_bin,\n"
             "end_bin) over the bins float32 cumulative counts at c_sum_address with total count total:\n"
             "alpha and beta step by 1e-5 in double, each threshold (alpha * total, beta * total) is\n"
             "rounded to float32 as torch rounds a Python float, and compared with the counts.");

static PyObject *search_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 9,
                    "search_walk(c_sum_address, bins, total, alpha, beta, start_bin, end_bin, n, max_steps)") < 0) {
        return NULL;
    }
    void *address;
    if (as_address(args[0], &address) < 0) {
        return NULL;
    }
    int64_t bins = PyLong_AsLongLong(args[1]);
    double total = PyFloat_AsDouble(args[2]);
    double alpha = PyFloat_AsDouble(args[3]);
    double beta = PyFloat_AsDouble(args[4]);
    int64_t start_bin = PyLong_AsLongLong(args[5]);
    int64_t end_bin = PyLong_AsLongLong(args[6]);
    int64_t n = PyLong_AsLongLong(args[7]);
    int64_t max_steps = PyLong_AsLongLong(args[8]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (address == NULL || bins <= 0 || start_bin < 0 || end_bin >= bins || start_bin > end_bin || n < 0) {
        PyErr_SetString(PyExc_ValueError, "search_walk needs a non-null address and 0 <= start_bin <= end_bin < bins");
        return NULL;
    }
    const float *c_sum = (const float *)address;
    const double stepsize = 1e-5;
    PyObject *pending = PyList_New(0);
    if (pending == NULL) {
        return NULL;
    }
    int64_t found = 0, steps = 0;
    /* _Walk.peek in torchao_observer_classes, step for step */
    while (found < n && alpha < beta && start_bin < end_bin) {
        if (found && steps >= max_steps) {
            break;
        }
        steps++;
        double next_alpha = alpha + stepsize;
        double next_beta = beta - stepsize;
        volatile float low = (float)(next_alpha * total); /* rounded to float32, as array('f') stores it */
        volatile float high = (float)(next_beta * total);
        double low_threshold = (double)low, high_threshold = (double)high;
        int64_t left = start_bin, right = end_bin;
        while (left < end_bin && (double)c_sum[left] < low_threshold) {
            left++;
        }
        while (right > start_bin && (double)c_sum[right] > high_threshold) {
            right--;
        }
        int64_t next_start_bin = start_bin, next_end_bin = end_bin;
        if ((left - start_bin) > (end_bin - right)) {
            next_start_bin = left;
            alpha = next_alpha;
        } else {
            next_end_bin = right;
            beta = next_beta;
        }
        if (next_start_bin == start_bin && next_end_bin == end_bin) {
            continue;
        }
        start_bin = next_start_bin;
        end_bin = next_end_bin;
        PyObject *item = Py_BuildValue("(ddLL)", alpha, beta, (long long)start_bin, (long long)end_bin);
        if (item == NULL || PyList_Append(pending, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(pending);
            return NULL;
        }
        Py_DECREF(item);
        found++;
    }
    return pending;
}

PyDoc_STRVAR(use_avx2_doc,
             "_use_avx2(flag) -> bool\n\nWhether the AVX2 code ran until now; from now on it runs if flag and "
             "the CPU has AVX2 (tests compare it with the SSE2 and scalar code).");

static PyObject *set_avx2(PyObject *self, PyObject *flag) {
    (void)self;
    int wanted = PyObject_IsTrue(flag);
    if (wanted < 0) {
        return NULL;
    }
#ifdef QP_AVX2
    int was = use_avx2;
    __builtin_cpu_init();
    use_avx2 = wanted && __builtin_cpu_supports("avx2");
    return PyBool_FromLong(was);
#else
    Py_RETURN_FALSE;
#endif
}

PyDoc_STRVAR(rebin_doc,
             "rebin(hist_address, bins, rate, mids_address, edges_address, base_address, out_address)"
             " -> bool\n\n"
             "torchao's re-binning of a float32 histogram onto new bin edges (see the C source); writes\n"
             "out = base + rebinned (base_address 0: rebinned) and returns True, or returns False and\n"
             "writes nothing when the mid-points or edges are not sorted or hold a NaN.");

static PyObject *rebin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_count(nargs, 7,
                    "rebin(hist_address, bins, rate, mids_address, edges_address, base_address, out_address)") < 0) {
        return NULL;
    }
    void *hist, *mids, *edges, *base, *out;
    if (as_address(args[0], &hist) < 0 || as_address(args[3], &mids) < 0 || as_address(args[4], &edges) < 0 ||
        as_address(args[5], &base) < 0 || as_address(args[6], &out) < 0) {
        return NULL;
    }
    int64_t bins = PyLong_AsLongLong(args[1]);
    int64_t rate = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (bins <= 0 || rate <= 0 || bins > (1 << 24) || rate > (1 << 24) / bins || hist == NULL || mids == NULL ||
        edges == NULL || out == NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "rebin needs non-null addresses (but base) and bins, rate > 0 with bins * rate <= 2**24");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = rebin_f32((const float *)hist, bins, rate, (const float *)mids, (const float *)edges,
                       (const float *)base, (float *)out);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        return PyErr_NoMemory();
    }
    return PyBool_FromLong(status == 0);
}

static PyMethodDef methods[] = {
    {"rebin", (PyCFunction)(void (*)(void))rebin, METH_FASTCALL, rebin_doc},
    {"minmax", (PyCFunction)(void (*)(void))minmax, METH_FASTCALL, minmax_doc},
    {"record_range", (PyCFunction)(void (*)(void))record_range, METH_FASTCALL, record_range_doc},
    {"minmax_rows", (PyCFunction)(void (*)(void))minmax_rows_py, METH_FASTCALL, minmax_rows_doc},
    {"bin_counts", (PyCFunction)(void (*)(void))bin_counts, METH_FASTCALL, bin_counts_doc},
    {"observe", (PyCFunction)(void (*)(void))observe, METH_FASTCALL, observe_doc},
    {"start", (PyCFunction)(void (*)(void))start, METH_FASTCALL, start_doc},
    {"row_extremes", (PyCFunction)(void (*)(void))row_extremes_py, METH_FASTCALL, row_extremes_doc},
    {"quantize_rows", (PyCFunction)(void (*)(void))quantize_rows_py, METH_FASTCALL, quantize_rows_doc},
    {"fake_quantize", (PyCFunction)(void (*)(void))fake_quantize_py, METH_FASTCALL, fake_quantize_doc},
    {"search_norms", (PyCFunction)(void (*)(void))search_norms, METH_FASTCALL, search_norms_doc},
    {"quantization_errors", (PyCFunction)(void (*)(void))quantization_errors_py, METH_FASTCALL,
     quantization_errors_doc},
    {"search_walk", (PyCFunction)(void (*)(void))search_walk, METH_FASTCALL, search_walk_doc},
    {"_use_avx2", set_avx2, METH_O, use_avx2_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_histogram_kernels",
    "Native min/max and histogram binning for quantplug's histogram observers.", -1, methods,
};

PyMODINIT_FUNC PyInit__histogram_kernels(void) {
#ifdef QP_AVX2
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
