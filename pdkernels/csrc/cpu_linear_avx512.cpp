// fp32 linear layer for x86 CPUs with AVX-512F: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), over
// the same packed panels as cpu_linear.cpp (16 output features each, k-major inside a panel:
// packed[(p * K + k) * 16 + j] = W[p * 16 + j][k], zero past N), so one packing serves both.
//
// A panel row is one 512-bit register. The micro-kernel takes two adjacent panels at once (32
// outputs) for groups of up to 12 rows: 24 accumulators, two weight registers, a broadcast; per
// k step two weight loads and 12 broadcasts feed 24 FMAs, so the FMA units, not the load ports,
// set the pace (one panel at a time would ask a load per FMA). An odd last panel runs alone.
//
// Each output is a plain sequential sum over k from the bias, the same fused multiply-adds in
// the same order as the AVX2 kernel's: the two give the same bits, and a row's result does not
// depend on how many other rows share the call.
//
// While a pair of panels is computed, the next pair is prefetched into L2, spread evenly over
// the passes of rows (as in cpu_linear.cpp, where asking for every line at once was measured to
// starve the FMAs).
//
// Plain C ABI, loaded with ctypes by pdkernels/cpu_linear.py; parallel over pairs of panels with
// OpenMP on the thread count the caller passes.

#include <immintrin.h>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: one 16-float register
constexpr int kMaxRows = 12;    // 12 rows x 2 panels = 24 accumulators, of 32 registers

struct Prefetch {               // lines of the next pair that one pass prefetches
    const char* from;           // [from, to) of the next pair's first panel, and the same
    const char* to;             // offsets of its second one (if any), one line of each every
    int64_t second;             // `every` k steps; `second` is the byte distance, 0 for none
    int64_t every;
};

inline void prefetch_step(Prefetch& pf) {
    if (pf.from < pf.to) {
        _mm_prefetch(pf.from, _MM_HINT_T1);
        if (pf.second) _mm_prefetch(pf.from + pf.second, _MM_HINT_T1);
        pf.from += 64;
    }
}

inline __mmask16 cols_mask(int64_t cols) {  // lanes [0, cols) of one panel, cols in [0, 16]
    return cols >= kPanel ? static_cast<__mmask16>(0xFFFF)
                          : static_cast<__mmask16>((1u << cols) - 1u);
}

// Rows x (Panels x 16) outputs of panels starting at `panel` (the second one `stride` floats
// after the first), `cols` of the last panel's 16 kept.
template <int Rows, int Panels>
inline void pair_rows(const float* __restrict x, int64_t K,
                      const float* __restrict panel, int64_t stride,
                      const float* __restrict bias, float* __restrict y, int64_t ldy,
                      int64_t cols, Prefetch pf) {
    __m512 acc[Rows][Panels];
    __m512 b[Panels];
#pragma GCC unroll 2
    for (int j = 0; j < Panels; ++j)
        b[j] = bias ? _mm512_loadu_ps(bias + j * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int m = 0; m < Rows; ++m)
#pragma GCC unroll 2
        for (int j = 0; j < Panels; ++j) acc[m][j] = b[j];
    int64_t countdown = 1;
    for (int64_t k = 0; k < K; ++k) {
        __m512 w[Panels];
#pragma GCC unroll 2
        for (int j = 0; j < Panels; ++j) w[j] = _mm512_loadu_ps(panel + j * stride + k * kPanel);
        if (--countdown == 0) {
            countdown = pf.every;
            prefetch_step(pf);
        }
#pragma GCC unroll 12
        for (int m = 0; m < Rows; ++m) {
            const __m512 v = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 2
            for (int j = 0; j < Panels; ++j) acc[m][j] = _mm512_fmadd_ps(v, w[j], acc[m][j]);
        }
    }
    const __mmask16 last = cols_mask(cols);
#pragma GCC unroll 12
    for (int m = 0; m < Rows; ++m) {
#pragma GCC unroll 2
        for (int j = 0; j < Panels; ++j) {
            if (j + 1 < Panels)
                _mm512_storeu_ps(y + m * ldy + j * kPanel, acc[m][j]);
            else
                _mm512_mask_storeu_ps(y + m * ldy + j * kPanel, last, acc[m][j]);
        }
    }
}

template <int Panels>
void rows_of(int rows, const float* x, int64_t K, const float* panel,
             int64_t stride, const float* bias, float* y, int64_t ldy, int64_t cols,
             Prefetch pf) {
    switch (rows) {
#define PDSERVE_ROWS(R) \
        case R: pair_rows<R, Panels>(x, K, panel, stride, bias, y, ldy, cols, pf); break;
        PDSERVE_ROWS(1) PDSERVE_ROWS(2) PDSERVE_ROWS(3) PDSERVE_ROWS(4) PDSERVE_ROWS(5)
        PDSERVE_ROWS(6) PDSERVE_ROWS(7) PDSERVE_ROWS(8) PDSERVE_ROWS(9) PDSERVE_ROWS(10)
        PDSERVE_ROWS(11) PDSERVE_ROWS(12)
#undef PDSERVE_ROWS
        default: break;
    }
}

void linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t N,
            const float* bias, float* y, int threads) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
    const int64_t pairs = (panels + 1) / 2;
    const int64_t groups = (M + kMaxRows - 1) / kMaxRows;  // rows split evenly over the groups
    const int64_t share = (K + groups - 1) / groups;       // k rows of the next pair per pass
    const int64_t panel_floats = K * kPanel;
    constexpr int64_t row_bytes = kPanel * sizeof(float);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && pairs > 1)
    for (int64_t q = 0; q < pairs; ++q) {
        const int64_t p = 2 * q;
        const int two = p + 1 < panels ? 2 : 1;
        const int64_t cols = N - (p + two - 1) * kPanel < kPanel ? N - (p + two - 1) * kPanel
                                                                 : kPanel;
        const float* panel = packed + p * panel_floats;
        const float* b = bias ? bias + p * kPanel : nullptr;
        // The next pair (or lone panel) to prefetch while this one computes.
        const char* next = p + 2 < panels
                               ? reinterpret_cast<const char*>(packed + (p + 2) * panel_floats)
                               : nullptr;
        const int64_t second = p + 3 < panels ? panel_floats * int64_t(sizeof(float)) : 0;
        int64_t m = 0;
        for (int64_t g = 0; g < groups; ++g) {
            const int rows = static_cast<int>((M - m) / (groups - g));
            const int64_t lo = g * share < K ? g * share : K;
            const int64_t hi = lo + share < K ? lo + share : K;
            const Prefetch pf{next ? next + lo * row_bytes : nullptr,
                              next ? next + hi * row_bytes : nullptr, second, groups};
            if (two == 2)
                rows_of<2>(rows, x + m * K, K, panel, panel_floats, b,
                           y + m * N + p * kPanel, N, cols, pf);
            else
                rows_of<1>(rows, x + m * K, K, panel, panel_floats, b,
                           y + m * N + p * kPanel, N, cols, pf);
            m += rows;
        }
    }
}

}  // namespace

extern "C" {

int64_t pdserve_linear512_panel() { return kPanel; }

// y[M, N] = x[M, K] @ W^T (+ bias): x and y contiguous row-major, W packed by cpu_linear.cpp's
// pdserve_linear_pack, bias (may be null) padded to a multiple of 16 floats.
void pdserve_linear512(const float* x, int64_t M, int64_t K, const float* packed, int64_t N,
                       const float* bias, float* y, int threads) {
    linear(x, M, K, packed, N, bias, y, threads);
}
}  // extern "C"
