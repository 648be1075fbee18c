// fp32 linear layer on Intel CPUs with AMX (Sapphire Rapids and later): y[M, N] = x[M, K] @
// W[N, K]^T (+ bias[N]) computed on the tile unit as three bf16 products per term.
//
// Each fp32 value v is split into two bf16 pieces, hi = bf16(v) and lo = bf16(v - hi) (round to
// nearest even both times), so v = hi + lo to within 2^-17 |v|. A product x * w is taken as
// xh * wh + xh * wl + xl * wh: what is left out (xl * wl and the pieces' own rounding) is about
// 2^-16 of |x * w|, and the sums are fp32. That is the "bf16x3" emulation of fp32 matrix
// products (cuBLAS and oneDNN name the same scheme): some 10x the rounding of a plain fp32 dot
// product, far below what moves a greedy token, at three tile products per term, where the tile
// unit does some 7x the fp32 FMA rate of a core's AVX-512 units.
//
// The weight is packed once: for every panel of 16 output features and every block of 32 k, two
// 1 KiB tiles (hi, then lo), each in the tile unit's pair-interleaved layout (row r holds, for
// each of the 16 features n, W[n][32 b + 2 r] and W[n][32 b + 2 r + 1]); panels are padded to an
// even count and k to a multiple of 32 with zeros. The rows of x are split per call into the
// same two pieces, k padded with zeros, rows to a multiple of 16.
//
// Tiles: for two row groups of 16 and two panels (32 x 32 outputs) four accumulators, two x
// tiles and two weight tiles; per block of 32 k, ten tile loads feed twelve tile products. Every
// output starts at its bias and adds, block by block, hi * hi, hi * lo, lo * hi: the same order
// whatever the row and panel grouping, so a row's result does not depend on the batch it is in.
// Rows go in blocks of 128 (their pieces stay in L2 while every panel pair passes over them),
// panel pairs are split over the OpenMP threads.
//
// Plain C ABI, loaded with ctypes by pdkernels/cpu_linear.py, which asks the kernel for tile
// permission (pdserve_amx_init) before the first call.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;      // output features per panel (one tile's 16 fp32 columns)
constexpr int64_t kBlockK = 32;     // k per tile product (16 pairs of bf16)
constexpr int64_t kTile = 512;      // bf16 elements of one 16 x 64-byte tile
constexpr int64_t kRowBlock = 128;  // rows whose x pieces stay in cache while panels pass

struct alignas(64) TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

void configure_tiles() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

inline uint16_t bf16_rne(float v) {   // round to nearest even (NaN kept a NaN)
    uint32_t u;
    std::memcpy(&u, &v, 4);
    if ((u & 0x7F800000u) == 0x7F800000u) return static_cast<uint16_t>((u >> 16) | ((u & 0xFFFF) ? 0x40 : 0));
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float bf16_value(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

inline void split(float v, uint16_t& hi, uint16_t& lo) {
    hi = bf16_rne(v);
    lo = bf16_rne(v - bf16_value(hi));
}

// Rows [0, M) of x into hi and lo pieces laid out as tiles: for row group g (16 rows) and block
// kb of 32 k, the hi tile at ((g * KB + kb) * 2) * 512 and the lo tile after it, row r of a tile
// the 32 k of row 16 g + r (zero past K and M). A tile is then 16 consecutive cache lines.
void split_rows(const float* x, int64_t M, int64_t K, int64_t Mp, int64_t KB, uint16_t* xt,
                int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 16)
    for (int64_t m = 0; m < Mp; ++m) {
        uint16_t* base = xt + (m / 16) * KB * 2 * kTile + (m % 16) * kBlockK;
        const float* row = x + m * K;
        for (int64_t kb = 0; kb < KB; ++kb) {
            uint16_t* h = base + kb * 2 * kTile;
            uint16_t* l = h + kTile;
            const int64_t k0 = kb * kBlockK;
            if (m < M && k0 + kBlockK <= K) {
                for (int half = 0; half < 2; ++half) {
                    const __m512 v = _mm512_loadu_ps(row + k0 + 16 * half);
                    const __m256i vh = (__m256i)_mm512_cvtneps_pbh(v);
                    const __m512 back = _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(vh), 16));
                    const __m256i vl = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + 16 * half), vh);
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l + 16 * half), vl);
                }
            } else {
                for (int64_t kk = 0; kk < kBlockK; ++kk) {
                    if (m < M && k0 + kk < K) split(row[k0 + kk], h[kk], l[kk]);
                    else h[kk] = l[kk] = 0;
                }
            }
        }
    }
}

// The next panel pair's weights into L2, a few lines at every block step of this pair's passes,
// so that they are in cache when its turn comes (tile loads that miss to memory stall the tile
// unit: the model's weights do not fit any cache).
struct Ahead {
    const char* from;
    const char* to;
    int64_t per_step;   // lines per block step
    inline void step() {
        for (int64_t i = 0; i < per_step && from < to; ++i, from += 64)
            _mm_prefetch(from, _MM_HINT_T1);
    }
};

// The 16 lines of one tile into L1.
inline void prefetch_tile(const uint16_t* t) {
    const char* c = reinterpret_cast<const char*>(t);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm_prefetch(c + 64 * i, _MM_HINT_T0);
}

inline void store_tile_part(const float* tile, float* y, int64_t ldy, int64_t rows,
                            int64_t cols) {
    const __mmask16 keep = cols >= kPanel ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << cols) - 1u);
    for (int64_t r = 0; r < rows; ++r)
        _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_loadu_ps(tile + r * kPanel));
}

struct Job {
    const uint16_t* xt;   // x pieces as tiles (split_rows)
    int64_t M, KB, N;
    const uint16_t* packed;
    const float* bias;    // padded to whole panels, or null
    float* y;
};

// Accumulators start at the bias of panels p, p + 1 (each row the same 16 values).
inline void bias_rows(const Job& j, int64_t p, float* b /* [2][16] */) {
    for (int t = 0; t < 2; ++t)
        for (int64_t n = 0; n < kPanel; ++n) {
            const int64_t f = (p + t) * kPanel + n;
            b[t * kPanel + n] = j.bias && f < j.N ? j.bias[f] : 0.0f;
        }
}

// Where accumulator tile (row group g, panel p + t) goes: straight into y (its 16 x 16 outputs
// all there: *ld the row stride of y in bytes), into `scratch` (*ld 64: some rows or columns
// past y's, then `finish` copies the rest), or nowhere (null: none of it is in y).
inline float* tile_target(const Job& j, int64_t m, int64_t p, int g, int t, float* scratch,
                          int64_t* ld) {
    const int64_t row = m + 16 * g, col = (p + t) * kPanel;
    if (col >= j.N || row >= j.M) return nullptr;
    if (row + 16 <= j.M && col + kPanel <= j.N) {
        *ld = j.N * static_cast<int64_t>(sizeof(float));
        return j.y + row * j.N + col;
    }
    *ld = 64;
    return scratch;
}

inline void finish(const Job& j, int64_t m, int64_t p, int g, int t, const float* scratch) {
    const int64_t row = m + 16 * g, col = (p + t) * kPanel;
    store_tile_part(scratch, j.y + row * j.N + col, j.N, j.M - row < 16 ? j.M - row : 16,
                    j.N - col < kPanel ? j.N - col : kPanel);
}

// _tile_stored takes its tile as a literal.
#define PDSERVE_STORE(T, g, t)                                         \
    do {                                                               \
        int64_t ld;                                                    \
        float* dst = tile_target(j, m, p, g, t, scratch, &ld);         \
        if (dst) {                                                     \
            _tile_stored(T, dst, ld);                                  \
            if (dst == scratch) finish(j, m, p, g, t, scratch);        \
        }                                                              \
    } while (0)

// 32 rows (two groups) x 32 outputs (panels p, p + 1). Tiles 0-3 accumulate (group g, panel t
// in tile 2 g + t), 4-5 hold x pieces, 6-7 weight pieces.
void two_groups(const Job& j, int64_t m, int64_t p, float* scratch, Ahead& ahead) {
    alignas(64) float b[2 * kPanel];
    bias_rows(j, p, b);
    _tile_loadd(0, b, 0);
    _tile_loadd(1, b + kPanel, 0);
    _tile_loadd(2, b, 0);
    _tile_loadd(3, b + kPanel, 0);
    const uint16_t* x0 = j.xt + (m / 16) * j.KB * 2 * kTile;
    const uint16_t* x1 = x0 + j.KB * 2 * kTile;
    const uint16_t* w0 = j.packed + p * j.KB * 2 * kTile;
    const uint16_t* w1 = w0 + j.KB * 2 * kTile;
    for (int64_t kb = 0; kb < j.KB; ++kb) {
        const uint16_t* xb0 = x0 + kb * 2 * kTile;
        const uint16_t* xb1 = x1 + kb * 2 * kTile;
        const uint16_t* wb0 = w0 + kb * 2 * kTile;
        const uint16_t* wb1 = w1 + kb * 2 * kTile;
        ahead.step();
        if (kb + 1 < j.KB) {   // the next block's tiles into L1 while this one computes
            prefetch_tile(xb0 + 2 * kTile);
            prefetch_tile(xb1 + 2 * kTile);
            prefetch_tile(wb0 + 2 * kTile);
            prefetch_tile(wb1 + 2 * kTile);
        }
        _tile_loadd(4, xb0, 64);
        _tile_loadd(6, wb0, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, xb1, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, wb1, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, xb0 + kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, xb1 + kTile, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, xb0, 64);
        _tile_loadd(6, wb0 + kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, xb1, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, wb1 + kTile, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    PDSERVE_STORE(0, 0, 0);
    PDSERVE_STORE(1, 0, 1);
    PDSERVE_STORE(2, 1, 0);
    PDSERVE_STORE(3, 1, 1);
}

// 16 rows x 32 outputs: tiles 0-1 accumulate, 2 holds an x piece, 3-6 the weight pieces. The
// same products in the same order as two_groups.
void one_group(const Job& j, int64_t m, int64_t p, float* scratch, Ahead& ahead) {
    alignas(64) float b[2 * kPanel];
    bias_rows(j, p, b);
    _tile_loadd(0, b, 0);
    _tile_loadd(1, b + kPanel, 0);
    const uint16_t* x0 = j.xt + (m / 16) * j.KB * 2 * kTile;
    const uint16_t* w0 = j.packed + p * j.KB * 2 * kTile;
    const uint16_t* w1 = w0 + j.KB * 2 * kTile;
    for (int64_t kb = 0; kb < j.KB; ++kb) {
        const uint16_t* xb = x0 + kb * 2 * kTile;
        const uint16_t* wb0 = w0 + kb * 2 * kTile;
        const uint16_t* wb1 = w1 + kb * 2 * kTile;
        ahead.step();
        if (kb + 1 < j.KB) {
            for (int t = 2; t < 4; ++t) {
                prefetch_tile(xb + t * kTile);
                prefetch_tile(wb0 + t * kTile);
                prefetch_tile(wb1 + t * kTile);
            }
        }
        _tile_loadd(2, xb, 64);
        _tile_loadd(3, wb0, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(4, wb1, 64);
        _tile_dpbf16ps(1, 2, 4);
        _tile_loadd(7, xb + kTile, 64);
        _tile_dpbf16ps(0, 7, 3);
        _tile_dpbf16ps(1, 7, 4);
        _tile_loadd(5, wb0 + kTile, 64);
        _tile_dpbf16ps(0, 2, 5);
        _tile_loadd(6, wb1 + kTile, 64);
        _tile_dpbf16ps(1, 2, 6);
    }
    PDSERVE_STORE(0, 0, 0);
    PDSERVE_STORE(1, 0, 1);
}

struct Buffer {   // the caller thread's x pieces, grown as needed, 64-byte aligned
    std::vector<uint16_t> data;
    uint16_t* get(int64_t n) {
        if (static_cast<int64_t>(data.size()) < n + 32) data.resize(n + 32);
        auto a = reinterpret_cast<uintptr_t>(data.data());
        return reinterpret_cast<uint16_t*>((a + 63) & ~uintptr_t(63));
    }
};

void linear(const float* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
            const float* bias, float* y, int threads) {
    const int64_t Kp = (K + kBlockK - 1) / kBlockK * kBlockK;
    const int64_t Mp = (M + 15) / 16 * 16;
    const int64_t panels = (N + kPanel - 1) / kPanel;
    const int64_t pairs = (panels + 1) / 2;
    static thread_local Buffer buffer;
    uint16_t* xt = buffer.get(2 * Mp * Kp);
    split_rows(x, M, K, Mp, Kp / kBlockK, xt, threads);
    const Job job{xt, M, Kp / kBlockK, N, packed, bias, y};
#pragma omp parallel num_threads(threads) if (threads > 1 && pairs > 1)
    {
        configure_tiles();
        alignas(64) float scratch[256];
        for (int64_t m0 = 0; m0 < Mp; m0 += kRowBlock) {
            const int64_t m1 = m0 + kRowBlock < Mp ? m0 + kRowBlock : Mp;
#pragma omp for schedule(static)
            for (int64_t q = 0; q < pairs; ++q) {
                const int64_t pair_bytes = job.KB * 4 * kTile * 2;
                const int64_t steps = (m1 - m0 + 31) / 32 * job.KB;
                const char* next = reinterpret_cast<const char*>(packed) + (q + 1) * pair_bytes;
                Ahead ahead{next, q + 1 < pairs ? next + pair_bytes : next,
                            (pair_bytes / 64 + steps - 1) / steps};
                int64_t m = m0;
                for (; m + 32 <= m1; m += 32) two_groups(job, m, 2 * q, scratch, ahead);
                if (m < m1) one_group(job, m, 2 * q, scratch, ahead);
            }
        }
        _tile_release();
    }
}

}  // namespace

extern "C" {

int64_t pdserve_amx_panel() { return kPanel; }

// Asks the kernel for the tile data state (Linux 5.16+); 0 when granted.
int pdserve_amx_init() {
    constexpr int kReqXcompPerm = 0x1023;
    constexpr int kXfeatureTileData = 18;
    return static_cast<int>(syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData));
}

// bf16 elements of W [N, K] packed: pairs of panels, blocks of 32 k, two pieces, one tile each.
int64_t pdserve_amx_packed_size(int64_t N, int64_t K) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
    return (panels + 1) / 2 * 2 * ((K + kBlockK - 1) / kBlockK) * 2 * kTile;
}

void pdserve_amx_pack(const float* w, int64_t N, int64_t K, uint16_t* out, int threads) {
    const int64_t KB = (K + kBlockK - 1) / kBlockK;
    const int64_t panels = (N + kPanel - 1) / kPanel;
    const int64_t padded = (panels + 1) / 2 * 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < padded; ++p)
        for (int64_t kb = 0; kb < KB; ++kb) {
            uint16_t* hi = out + (p * KB + kb) * 2 * kTile;
            uint16_t* lo = hi + kTile;
            for (int64_t r = 0; r < 16; ++r)
                for (int64_t n = 0; n < kPanel; ++n)
                    for (int64_t t = 0; t < 2; ++t) {
                        const int64_t f = p * kPanel + n, k = kb * kBlockK + 2 * r + t;
                        const float v = f < N && k < K ? w[f * K + k] : 0.0f;
                        split(v, hi[r * 32 + n * 2 + t], lo[r * 32 + n * 2 + t]);
                    }
        }
}

// y[M, N] = x[M, K] @ W^T (+ bias): x and y contiguous row-major, W from pdserve_amx_pack, bias
// (may be null) at least N floats.
void pdserve_amx_linear(const float* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                        const float* bias, float* y, int threads) {
    linear(x, M, K, packed, N, bias, y, threads);
}
}  // extern "C"
