// fp32 linear layer for x86 CPUs with AVX2 and FMA: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]),
// and its weight-only int8 twin: W = Q * scale[N], Q int8, read 4x less memory (the same panels
// of int8, widened to fp32 in registers; the scale and bias applied once at the end).
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
// prefetches queue, the FMAs wait behind them, and 9 to 32 rows ran 25-35% slower (reading the
// weight and computing on it did not overlap).
//
// Plain C ABI (no torch headers): loaded with ctypes by kernels/cpu_linear.py, which compiles it
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

// rows x 16 outputs of one panel, prefetching its share of the next panel on the way. fp32
// (scale null): the sums start from the bias. int8: sum(x * q) * scale + bias per feature.
template <int Rows, typename W>
inline void panel_rows(const float* __restrict x, int64_t K, const W* __restrict panel,
                       const float* __restrict scale, const float* __restrict bias,
                       float* __restrict y, int64_t ldy, int64_t cols, Prefetch pf) {
    __m256 acc[Rows][2];
    const bool fold = bias && !scale;    // fp32: the bias is where the sums start
    const __m256 b0 = fold ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = fold ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
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
    if (scale) {
        const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
        const __m256 c0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        const __m256 c1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            acc[m][0] = _mm256_fmadd_ps(acc[m][0], s0, c0);
            acc[m][1] = _mm256_fmadd_ps(acc[m][1], s1, c1);
        }
    }
    if (cols == kPanel) {
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            _mm256_storeu_ps(y + m * ldy, acc[m][0]);
            _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
        }
    } else {  // the last panel of an N that is not a multiple of 16
        const __m256i lo = tail_mask(cols < 8 ? cols : 8), hi = tail_mask(cols > 8 ? cols - 8 : 0);
#pragma GCC unroll 8
        for (int m = 0; m < Rows; ++m) {
            _mm256_maskstore_ps(y + m * ldy, lo, acc[m][0]);
            _mm256_maskstore_ps(y + m * ldy + 8, hi, acc[m][1]);
        }
    }
}

template <typename W>
void rows_of_panel(int rows, const float* x, int64_t K, const W* panel, const float* scale,
                   const float* bias, float* y, int64_t ldy, int64_t cols, Prefetch pf) {
    switch (rows) {
        case 1: panel_rows<1>(x, K, panel, scale, bias, y, ldy, cols, pf); break;
        case 2: panel_rows<2>(x, K, panel, scale, bias, y, ldy, cols, pf); break;
        case 3: panel_rows<3>(x, K, panel, scale, bias, y, ldy, cols, pf); break;
        case 4: panel_rows<4>(x, K, panel, scale, bias, y, ldy, cols, pf); break;
        case 5: panel_rows<5>(x, K, panel, scale, bias, y, ldy, cols, pf); break;
        default: panel_rows<6>(x, K, panel, scale, bias, y, ldy, cols, pf); break;
    }
}

// y[M, N] = x[M, K] @ W^T (* scale) (+ bias) over packed panels of W (fp32 or int8).
template <typename W>
void linear(const float* x, int64_t M, int64_t K, const W* packed, int64_t N,
            const float* scale, const float* bias, float* y, int threads) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
    const int64_t groups = (M + kMaxRows - 1) / kMaxRows;  // rows split evenly over the groups
    const int64_t row_bytes = kPanel * static_cast<int64_t>(sizeof(W));   // one k row of a panel
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; ++p) {
        const W* panel = packed + p * K * kPanel;
        const char* next = p + 1 < panels ? reinterpret_cast<const char*>(panel + K * kPanel)
                                          : nullptr;
        const int64_t share = (K + groups - 1) / groups;  // k rows of `next` per pass
        const float* ps = scale ? scale + p * kPanel : nullptr;
        const float* pb = bias ? bias + p * kPanel : nullptr;
        const int64_t cols = N - p * kPanel < kPanel ? N - p * kPanel : kPanel;
        int64_t m = 0;
        for (int64_t g = 0; g < groups; ++g) {
            const int rows = static_cast<int>((M - m) / (groups - g));
            const int64_t lo = g * share < K ? g * share : K;
            const int64_t hi = lo + share < K ? lo + share : K;
            const Prefetch pf{next ? next + lo * row_bytes : nullptr,
                              next ? next + hi * row_bytes : nullptr, groups};
            rows_of_panel(rows, x + m * K, K, panel, ps, pb, y + m * N + p * kPanel, N, cols, pf);
            m += rows;
        }
    }
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
    linear(x, M, K, packed, N, static_cast<const float*>(nullptr), bias, y, threads);
}

// y[M, N] = (x[M, K] @ Q^T) * scale (+ bias) with Q int8 panels; scale and bias (may be null)
// padded to a multiple of 16 floats.
void pdserve_linear_i8(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N,
                       const float* scale, const float* bias, float* y, int threads) {
    linear(x, M, K, packed, N, scale, bias, y, threads);
}

}  // extern "C"
