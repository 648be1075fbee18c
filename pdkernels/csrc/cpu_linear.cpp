// fp32 linear layer for x86 CPUs with AVX2 and FMA: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]),
// and its int8 twin: W[n][k] = Q[n][k] * scale[n][k / G], Q int8 (the same panels, 4x less
// memory to read), with one scale per feature (G = K: weight-only int8) or per group of G
// inputs (pre-quantized 4- and 8-bit checkpoints). Its weights are widened to fp32 in registers
// (few rows) or once per call into an L1 buffer (more rows), and each group's sums are scaled
// once: the same products and sums either way.
//
// The weight is packed once into panels of 16 output features, k-major inside a panel:
// packed[(p * K + k) * 16 + j] = W[p * 16 + j][k] (zero past N). A panel is streamed from memory
// once per call and reused from cache for every group of up to 6 rows, whose 6 x 16 outputs stay
// in 12 AVX registers for the whole K loop. Each output is a plain sequential sum over k, so a
// row's result does not depend on how many other rows share the call.
//
// While a panel is computed, the next one is prefetched into L2, spread evenly over the passes
// (one 64-byte line every `groups` k steps, each pass its share of the lines). Issuing a line
// every k step instead, as fast as one pass runs, asks more of memory than one core gets: the
// prefetches queue, the FMAs wait behind them, and reading the weight and computing on it no
// longer overlap (measured: docs/performance.md, "CPU linear layers").
//
// Plain C ABI (no torch headers): loaded with ctypes by pdkernels/cpu_linear.py, which compiles it
// on first use. Parallel over panels with OpenMP on the number of threads the caller passes (the
// caller's torch thread count: OpenMP's own default would be every core, in whichever thread
// calls).

#include <immintrin.h>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: two 8-float AVX registers
constexpr int kMaxRows = 6;     // 6 rows x 2 registers = 12 accumulators, of 16 registers

__m256i tail_mask(int64_t n) {  // lanes [0, n) set, n in [0, 8]
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes);
}

// Lines of the next panel that one pass prefetches: [from, to), one 64-byte line every `every`
// k steps.
struct Prefetch {
    const char* from;
    const char* to;
    int64_t every;
};

// The 16 weights of panel row k as two 8-float registers: fp32 panels as they are; int8 panels
// (weight-only int8: 16 bytes a row) widened to int32, then converted (exact: |q| <= 127).
inline void load_row(const float* panel, int64_t k, __m256& w0, __m256& w1) {
    w0 = _mm256_loadu_ps(panel + k * kPanel);
    w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
}

inline void load_row(const int8_t* panel, int64_t k, __m256& w0, __m256& w1) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * kPanel));
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
}

// Rows x 16 outputs to y (the last panel of an N that is not a multiple of 16: `cols` of them).
template <int Rows>
inline void store_rows(__m256 (&acc)[Rows][2], float* __restrict y, int64_t ldy, int64_t cols) {
    if (cols == kPanel) {
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            _mm256_storeu_ps(y + m * ldy, acc[m][0]);
            _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
        }
    } else {
        const __m256i lo = tail_mask(cols < 8 ? cols : 8), hi = tail_mask(cols > 8 ? cols - 8 : 0);
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            _mm256_maskstore_ps(y + m * ldy, lo, acc[m][0]);
            _mm256_maskstore_ps(y + m * ldy + 8, hi, acc[m][1]);
        }
    }
}

// rows x 16 outputs of one fp32 panel, prefetching its share of the next panel on the way.
template <int Rows>
inline void panel_rows(const float* __restrict x, int64_t K, const float* __restrict panel,
                       const float* __restrict bias, float* __restrict y, int64_t ldy,
                       int64_t cols, Prefetch pf) {
    __m256 acc[Rows][2];
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();   // the sums start
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();  // from the bias
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
        acc[m][0] = b0;
        acc[m][1] = b1;
    }
    int64_t countdown = 1;
    for (int64_t k = 0; k < K; ++k) {
        __m256 w0, w1;
        load_row(panel, k, w0, w1);
        if (--countdown == 0) {
            countdown = pf.every;
            if (pf.from < pf.to) {
                _mm_prefetch(pf.from, _MM_HINT_T1);
                pf.from += 64;
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            const __m256 xm = _mm256_broadcast_ss(x + m * K + k);
            acc[m][0] = _mm256_fmadd_ps(xm, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xm, w1, acc[m][1]);
        }
    }
    store_rows<Rows>(acc, y, ldy, cols);
}

// int8 weights with scales, few rows (the register kernel): each k row of the panel is widened
// in registers and fed to the FMAs; each group's sums of x * q are folded in with its scales,
// acc = part * s + acc (from the bias), or with one scale per feature (Late: G = K) scaled once
// at the end, sum * s + bias.
// The L1-buffer kernel below computes exactly these products and sums in the same order, so a
// row's result does not depend on which kernel, or how many other rows, its call had.
constexpr int kMaxScaledRows = 2;

// The last step of a Late sum: acc * scale + bias (bias may be null).
template <int Rows>
inline void scale_late(__m256 (&acc)[Rows][2], const float* __restrict s,
                       const float* __restrict bias) {
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    const __m256 c0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 c1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
        acc[m][0] = _mm256_fmadd_ps(acc[m][0], s0, c0);
        acc[m][1] = _mm256_fmadd_ps(acc[m][1], s1, c1);
    }
}

template <int Rows, bool Late>
inline void panel_rows_scaled(const float* __restrict x, int64_t K, const int8_t* __restrict panel,
                              int64_t G, const float* __restrict scales,
                              const float* __restrict bias, float* __restrict y, int64_t ldy,
                              int64_t cols, Prefetch pf) {
    __m256 acc[Rows][2];
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
        acc[m][0] = bias && !Late ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        acc[m][1] = bias && !Late ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    }
    int64_t countdown = 1;
    for (int64_t k0 = 0; k0 < K; k0 += G) {
        const int64_t k1 = k0 + G < K ? k0 + G : K;
        __m256 part[Rows][2];             // this group's sums (Late: the whole K's, in acc)
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            part[m][0] = Late ? acc[m][0] : _mm256_setzero_ps();
            part[m][1] = Late ? acc[m][1] : _mm256_setzero_ps();
        }
        for (int64_t k = k0; k < k1; ++k) {
            __m256 w0, w1;
            load_row(panel, k, w0, w1);
            if (--countdown == 0) {
                countdown = pf.every;
                if (pf.from < pf.to) {
                    _mm_prefetch(pf.from, _MM_HINT_T1);
                    pf.from += 64;
                }
            }
#pragma GCC unroll 8
            for (int m = 0; m < Rows; ++m) {
                const __m256 xm = _mm256_broadcast_ss(x + m * K + k);
                part[m][0] = _mm256_fmadd_ps(xm, w0, part[m][0]);
                part[m][1] = _mm256_fmadd_ps(xm, w1, part[m][1]);
            }
        }
        const float* s = scales + (k0 / G) * kPanel;
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            acc[m][0] = Late ? part[m][0] : _mm256_fmadd_ps(part[m][0], s0, acc[m][0]);
            acc[m][1] = Late ? part[m][1] : _mm256_fmadd_ps(part[m][1], s1, acc[m][1]);
        }
    }
    if (Late) scale_late<Rows>(acc, scales, bias);
    store_rows<Rows>(acc, y, ldy, cols);
}

void rows_of_panel(int rows, const float* x, int64_t K, const float* panel, const float* bias,
                   float* y, int64_t ldy, int64_t cols, Prefetch pf) {
    switch (rows) {
        case 1: panel_rows<1>(x, K, panel, bias, y, ldy, cols, pf); break;
        case 2: panel_rows<2>(x, K, panel, bias, y, ldy, cols, pf); break;
        case 3: panel_rows<3>(x, K, panel, bias, y, ldy, cols, pf); break;
        case 4: panel_rows<4>(x, K, panel, bias, y, ldy, cols, pf); break;
        case 5: panel_rows<5>(x, K, panel, bias, y, ldy, cols, pf); break;
        default: panel_rows<6>(x, K, panel, bias, y, ldy, cols, pf); break;
    }
}

// int8 weights with scales, many rows (the L1-buffer kernel): each chunk of a panel (at most
// kChunk k rows of one group) is widened and scaled once into an L1 buffer of fp32 weights, then
// every pass of up to 6 rows runs the fp32 micro-kernel over it, its sums carried in y from
// chunk to chunk (a row's sum is still one sequential sum over k, from the bias; with one scale
// per feature, the buffer holds the widened q and the last chunk scales the sums).
constexpr int64_t kChunk = 256;   // 16 x 256 floats: 16 KiB of L1

// One chunk's rows: Late (one scale per feature), the sums carried in y from chunk to chunk
// and scaled by `late` (with `bias`) after the last; otherwise a chunk is one group, its sums
// from zero folded into y (the bias first) with the group's scales `s`.
template <int Rows, bool Late>
inline void chunk_rows(const float* __restrict x, int64_t K, int64_t kc,
                       const float* __restrict w, const float* __restrict bias, bool first,
                       const float* __restrict s, const float* __restrict late,
                       float* __restrict y, int64_t ldy, int64_t cols) {
    __m256 acc[Rows][2];
    const __m256i lo = tail_mask(cols < 8 ? cols : 8), hi = tail_mask(cols > 8 ? cols - 8 : 0);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
        if (Late && !first) {
            acc[m][0] = _mm256_maskload_ps(y + m * ldy, lo);
            acc[m][1] = _mm256_maskload_ps(y + m * ldy + 8, hi);
        } else {
            acc[m][0] = _mm256_setzero_ps();
            acc[m][1] = _mm256_setzero_ps();
        }
    }
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 w0 = _mm256_load_ps(w + k * kPanel), w1 = _mm256_load_ps(w + k * kPanel + 8);
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            const __m256 xm = _mm256_broadcast_ss(x + m * K + k);
            acc[m][0] = _mm256_fmadd_ps(xm, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xm, w1, acc[m][1]);
        }
    }
    if (Late) {
        if (late) scale_late<Rows>(acc, late, bias);
    } else {
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            const __m256 p0 = first ? (bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps())
                                    : _mm256_maskload_ps(y + m * ldy, lo);
            const __m256 p1 = first ? (bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps())
                                    : _mm256_maskload_ps(y + m * ldy + 8, hi);
            acc[m][0] = _mm256_fmadd_ps(acc[m][0], s0, p0);
            acc[m][1] = _mm256_fmadd_ps(acc[m][1], s1, p1);
        }
    }
    store_rows<Rows>(acc, y, ldy, cols);
}

template <bool Late>
void chunk_pass(int rows, const float* x, int64_t K, int64_t kc, const float* w, const float* b,
                bool first, const float* s, const float* fin, float* y, int64_t ldy,
                int64_t cols) {
    switch (rows) {
        case 1: chunk_rows<1, Late>(x, K, kc, w, b, first, s, fin, y, ldy, cols); break;
        case 2: chunk_rows<2, Late>(x, K, kc, w, b, first, s, fin, y, ldy, cols); break;
        case 3: chunk_rows<3, Late>(x, K, kc, w, b, first, s, fin, y, ldy, cols); break;
        case 4: chunk_rows<4, Late>(x, K, kc, w, b, first, s, fin, y, ldy, cols); break;
        case 5: chunk_rows<5, Late>(x, K, kc, w, b, first, s, fin, y, ldy, cols); break;
        default: chunk_rows<6, Late>(x, K, kc, w, b, first, s, fin, y, ldy, cols); break;
    }
}

void linear_buffered(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N,
                         const float* scales, int64_t G, const float* bias, float* y,
                         int threads) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
    const int64_t ngroups = (K + G - 1) / G;
    const int64_t passes = (M + kMaxRows - 1) / kMaxRows;
    const int8_t* end = packed + panels * K * kPanel;
    const bool late = G >= K;                 // one scale per feature: applied at the end
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; ++p) {
        alignas(32) float w[kChunk * kPanel];
        const int8_t* panel = packed + p * K * kPanel;
        const int64_t cols = N - p * kPanel < kPanel ? N - p * kPanel : kPanel;
        const float* b = bias ? bias + p * kPanel : nullptr;
        for (int64_t k0 = 0; k0 < K;) {
            const int64_t g = k0 / G;
            const int64_t group_end = (g + 1) * G < K ? (g + 1) * G : K;
            const int64_t kc = group_end - k0 < kChunk ? group_end - k0 : kChunk;
            const float* s = scales + (p * ngroups + g) * kPanel;
            const int8_t* q = panel + k0 * kPanel;
            for (int64_t k = 0; k < kc; ++k) {
                const int8_t* ahead = q + (kc + k) * kPanel;     // the next chunk's rows
                if ((k & 3) == 0 && ahead < end)
                    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
                __m256 w0, w1;
                load_row(q, k, w0, w1);
                _mm256_store_ps(w + k * kPanel, w0);
                _mm256_store_ps(w + k * kPanel + 8, w1);
            }
            const float* fin = late && k0 + kc >= K ? s : nullptr;     // the last chunk's
            const bool first = k0 == 0;
            int64_t m = 0;
            for (int64_t pass = 0; pass < passes; ++pass) {
                const int rows = static_cast<int>((M - m) / (passes - pass));
                const float* xm = x + m * K + k0;
                float* out = y + m * N + p * kPanel;
                if (late)
                    chunk_pass<true>(rows, xm, K, kc, w, b, first, s, fin, out, N, cols);
                else
                    chunk_pass<false>(rows, xm, K, kc, w, b, first, s, fin, out, N, cols);
                m += rows;
            }
            k0 += kc;
        }
    }
}

// Every panel of W (packed, K rows of 16 W elements each), its rows of x in groups of at most
// MaxRows: run(rows, panel index, first row, Prefetch) computes one group's outputs.
template <int MaxRows, typename W, typename Run>
void over_panels(int64_t M, int64_t K, int64_t N, const W* packed, int threads, Run run) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
    const int64_t groups = (M + MaxRows - 1) / MaxRows;   // rows split evenly over the groups
    const int64_t row_bytes = kPanel * static_cast<int64_t>(sizeof(W));   // one k row of a panel
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; ++p) {
        const char* next = p + 1 < panels
                               ? reinterpret_cast<const char*>(packed + (p + 1) * K * kPanel)
                               : nullptr;
        const int64_t share = (K + groups - 1) / groups;  // k rows of `next` per pass
        int64_t m = 0;
        for (int64_t g = 0; g < groups; ++g) {
            const int rows = static_cast<int>((M - m) / (groups - g));
            const int64_t lo = g * share < K ? g * share : K;
            const int64_t hi = lo + share < K ? lo + share : K;
            run(rows, p, m, Prefetch{next ? next + lo * row_bytes : nullptr,
                                     next ? next + hi * row_bytes : nullptr, groups});
            m += rows;
        }
    }
}

// y[M, N] = x[M, K] @ W^T (+ bias) over packed fp32 panels of W.
void linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t N,
            const float* bias, float* y, int threads) {
    over_panels<kMaxRows>(M, K, N, packed, threads, [&](int rows, int64_t p, int64_t m,
                                                         Prefetch pf) {
        const int64_t cols = N - p * kPanel < kPanel ? N - p * kPanel : kPanel;
        rows_of_panel(rows, x + m * K, K, packed + p * K * kPanel,
                      bias ? bias + p * kPanel : nullptr, y + m * N + p * kPanel, N, cols, pf);
    });
}

// y = x @ (Q * scales)^T (+ bias) for up to kMaxScaledRows rows, scales packed
// [panel][K / G][16] (per feature: G = K, [panel][1][16]).
void linear_scaled(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N,
                   const float* scales, int64_t G, const float* bias, float* y, int threads) {
    const int64_t ngroups = (K + G - 1) / G;
    over_panels<kMaxScaledRows>(M, K, N, packed, threads, [&](int rows, int64_t p, int64_t m,
                                                               Prefetch pf) {
        const int64_t cols = N - p * kPanel < kPanel ? N - p * kPanel : kPanel;
        const int8_t* panel = packed + p * K * kPanel;
        const float* s = scales + p * ngroups * kPanel;
        const float* b = bias ? bias + p * kPanel : nullptr;
        float* out = y + m * N + p * kPanel;
        const bool late = G >= K;
        if (rows == 1 && late)
            panel_rows_scaled<1, true>(x + m * K, K, panel, G, s, b, out, N, cols, pf);
        else if (rows == 1)
            panel_rows_scaled<1, false>(x + m * K, K, panel, G, s, b, out, N, cols, pf);
        else if (late)
            panel_rows_scaled<2, true>(x + m * K, K, panel, G, s, b, out, N, cols, pf);
        else
            panel_rows_scaled<2, false>(x + m * K, K, panel, G, s, b, out, N, cols, pf);
    });
}

// int8 weights with scales, any rows: the register kernel up to kMaxScaledRows rows, beyond
// that the L1 buffer, which widens each weight once per call instead of once per pass of rows
// (the widening, not the reads, dominates there; measured: docs/performance.md).
void linear_i8(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N,
               const float* scales, int64_t G, const float* bias, float* y, int threads) {
    if (M > kMaxScaledRows && (G >= K || G <= kChunk))   // a chunk holds a whole group
        linear_buffered(x, M, K, packed, N, scales, G, bias, y, threads);
    else
        linear_scaled(x, M, K, packed, N, scales, G, bias, y, threads);
}

template <typename W>
void pack(const W* w, int64_t N, int64_t K, W* out, int threads) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < panels; ++p) {
        for (int64_t k = 0; k < K; ++k) {
            for (int64_t j = 0; j < kPanel; ++j) {
                const int64_t n = p * kPanel + j;
                out[(p * K + k) * kPanel + j] = n < N ? w[n * K + k] : W(0);
            }
        }
    }
}

}  // namespace

extern "C" {

int64_t pdserve_linear_panel() { return kPanel; }

// Pack W[N, K] (row-major) into ceil(N / 16) panels; `out` holds ceil(N / 16) * 16 * K floats.
void pdserve_linear_pack(const float* w, int64_t N, int64_t K, float* out, int threads) {
    pack(w, N, K, out, threads);
}

// The same panels of an int8 weight (weight-only int8: its per-feature scales stay apart).
void pdserve_linear_pack_i8(const int8_t* w, int64_t N, int64_t K, int8_t* out, int threads) {
    pack(w, N, K, out, threads);
}

// y[M, N] = x[M, K] @ W^T (+ bias). x and y are contiguous row-major; bias (may be null) is
// padded to a multiple of 16 floats.
void pdserve_linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t N,
                    const float* bias, float* y, int threads) {
    linear(x, M, K, packed, N, bias, y, threads);
}

// y[M, N] = x[M, K] @ W^T (+ bias), W[n][k] = Q[n][k] * scales[n][k / G]: Q int8 panels, scales
// packed [panel][ceil(K / G)][16] (zero past N; per feature, G = K: [panel][1][16]), bias (may
// be null) padded to 16 floats.
void pdserve_linear_i8_grouped(const float* x, int64_t M, int64_t K, const int8_t* packed,
                               int64_t N, const float* scales, int64_t G, const float* bias,
                               float* y, int threads) {
    linear_i8(x, M, K, packed, N, scales, G, bias, y, threads);
}
}  // extern "C"
