// Paged attention for x86 CPUs with AVX2 and FMA, fp32: decodes and short queries after cached
// context (speculative verification, the tail of a prompt whose prefix was cached), read in place
// through each sequence's block table (no gather into new buffers).
//
// Contract (the same as pdkernels/triton_attention.py's paged_attention, whose torch reference
// paged_attention_ref it is tested against): sequence i has q_lens[i] new queries at rows
// q_start[i] .. of q, and seq_lens[i] tokens of context, the new ones included, already in the
// cache; query j sits at position seq_lens[i] - q_lens[i] + j and attends keys at positions <= its
// own. The cache of one layer: k, v [num_blocks, block_size, kv_heads, head_dim] with strides
// (kv_stride_b, kv_stride_s, kv_stride_h) in floats, last dim contiguous.
//
// Work: one task per sequence and run of up to kMaxRows rows, parallel with OpenMP on the
// caller's thread count. A row is a (query, head) pair; a run holds every head of its queries, so
// each K/V row loaded (all KV heads of a token, contiguous) serves every query head, and each
// block is read whole, in address order (a block per KV head would read a third of each block's
// lines per pass and leave the prefetcher nothing to follow, several times slower:
// docs/performance.md, "CPU attention"). Two passes over a run's context: the scores of every
// row against every key (the K blocks in table order, four keys at a time, their sums reduced
// together), one exact softmax per row in fp32, then the weighted V rows added into the row
// accumulators (the V blocks in table order, 32 columns of up to 3 rows in registers). The
// blocks kAhead ahead in that stream (K blocks, then V blocks) are prefetched into L2 while one
// is computed on: into L1 (T0), a core keeps few lines in flight and at batch 64 it read the KV
// cache at 6 GB/s, 1.6x slower (docs/performance.md, "CPU attention"). exp is a vectorized
// Cephes-style polynomial (relative error ~2e-7); masked keys contribute exactly 0.
//
// A layer may add: a sliding window (a query sees its last `window` positions; the blocks
// wholly before every row's window are not read), soft-capped scores (softcap * tanh(s /
// softcap)), and a sink logit per head that joins each row's softmax and has no value.
//
// Plain C ABI (no torch headers), loaded with ctypes by pdkernels/cpu_attention.py.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int kMaxRows = 16;     // rows (query x head) per pass over a sequence's context
constexpr int kMaxBlock = 64;    // largest block_size taken (the prefetch distance is in blocks)

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// e^x for x <= 0 (scores minus their running max); below -87 the result is 0.
inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - n ln2, ln2 split in two for precision
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, p);
}

struct Layer {
    const float* k;
    const float* v;
    int64_t stride_b, stride_s, stride_h;   // floats
    int64_t block_size, head_dim;
};

constexpr int kAhead = 2;        // blocks read ahead of the one computed on

// The 64-byte lines [from, to) of a block (bytes), into L2.
inline void prefetch(const float* p, int64_t from, int64_t to) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t off = from; off < to; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// Four key sums per row of accumulators a[0..3] -> [s0 s1 s2 s3].
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores s[i][t] = q_i . k_t of N rows that share a KV head (queries qb[i * D ..], pre-scaled)
// against the n keys of one block: KT keys at a time, N x KT independent FMA chains, each key
// row loaded once for the N rows, the KT sums of a row reduced together into one vector.
template <int N>
inline void score(const float* qb, const float* kb, int64_t stride_s, int64_t n, int64_t D,
                  float* s, int64_t s_stride) {
    constexpr int KT = N <= 3 ? 4 : 2;           // N * KT accumulators, of 16 registers
    int64_t t = 0;
    for (; t + KT <= n; t += KT) {
        __m256 a[N][KT];
        for (int i = 0; i < N; ++i)
            for (int j = 0; j < KT; ++j) a[i][j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 x[KT];
            for (int j = 0; j < KT; ++j) x[j] = _mm256_loadu_ps(kb + (t + j) * stride_s + d);
            for (int i = 0; i < N; ++i) {
                const __m256 qv = _mm256_loadu_ps(qb + i * D + d);
                for (int j = 0; j < KT; ++j) a[i][j] = _mm256_fmadd_ps(qv, x[j], a[i][j]);
            }
        }
        for (int i = 0; i < N; ++i) {
            if constexpr (KT == 4) {
                _mm_storeu_ps(s + i * s_stride + t, reduce4(a[i][0], a[i][1], a[i][2], a[i][3]));
            } else {
                for (int j = 0; j < KT; ++j) s[i * s_stride + t + j] = hsum(a[i][j]);
            }
        }
    }
    for (; t < n; ++t) {
        const float* kt = kb + t * stride_s;
        __m256 a[N];
        for (int i = 0; i < N; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 k = _mm256_loadu_ps(kt + d);
            for (int i = 0; i < N; ++i)
                a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + i * D + d), k, a[i]);
        }
        for (int i = 0; i < N; ++i) s[i * s_stride + t] = hsum(a[i]);
    }
}

// acc[i][d] += sum_t p[i][t] * v[t][d] for N rows sharing a KV head and the n keys of one block,
// C columns at a time held in registers across the block's keys (each V row loaded once for
// the N rows).
template <int N, int C>
inline void accumulate_cols(float* acc, const float* vb, int64_t stride_s, int64_t n, int64_t D,
                            const float* p, int64_t p_stride, int64_t d) {
    constexpr int R = C / 8;
    __m256 a[N][R];
    for (int i = 0; i < N; ++i)
        for (int c = 0; c < R; ++c) a[i][c] = _mm256_loadu_ps(acc + i * D + d + 8 * c);
    for (int64_t t = 0; t < n; ++t) {
        __m256 x[R];
        for (int c = 0; c < R; ++c) x[c] = _mm256_loadu_ps(vb + t * stride_s + d + 8 * c);
        for (int i = 0; i < N; ++i) {
            const __m256 w = _mm256_broadcast_ss(p + i * p_stride + t);
            for (int c = 0; c < R; ++c) a[i][c] = _mm256_fmadd_ps(w, x[c], a[i][c]);
        }
    }
    for (int i = 0; i < N; ++i)
        for (int c = 0; c < R; ++c) _mm256_storeu_ps(acc + i * D + d + 8 * c, a[i][c]);
}

template <int N>
inline void accumulate(float* acc, const float* vb, int64_t stride_s, int64_t n, int64_t D,
                       const float* p, int64_t p_stride) {
    constexpr int C = N <= 3 ? 32 : 16;          // N * C / 8 accumulators, of 16 registers
    int64_t d = 0;
    for (; d + C <= D; d += C) accumulate_cols<N, C>(acc, vb, stride_s, n, D, p, p_stride, d);
    for (; d + 16 <= D; d += 16) accumulate_cols<N, 16>(acc, vb, stride_s, n, D, p, p_stride, d);
    for (; d < D; d += 8) accumulate_cols<N, 8>(acc, vb, stride_s, n, D, p, p_stride, d);
}

template <typename F>
inline void by_width(int n, F f) {   // f(std::integral_constant<int, n>) for n in 1..4
    switch (n) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        default: f(std::integral_constant<int, 4>{}); break;
    }
}

// Softmax of one row's scores s[lo, limit) in place, the rest of s[0, padded) set to 0
// (padded: a multiple of 8), the visible scores soft-capped first when softcap > 0; `sink`
// (-inf: none) joins the softmax without a value. Returns the sum of the unnormalized weights
// exp(s - max), the sink's included.
inline float softmax_row(float* s, int64_t lo, int64_t limit, int64_t padded, float softcap,
                         float sink) {
    for (int64_t t = 0; t < lo; ++t) s[t] = -INFINITY;
    for (int64_t t = limit; t < padded; ++t) s[t] = -INFINITY;
    if (softcap > 0.0f)
        for (int64_t t = lo; t < limit; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < padded; t += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = std::max(_mm_cvtss_f32(m4), sink);
    if (mx == -INFINITY) {                        // no visible key (cannot happen: limit >= 1)
        std::fill(s, s + padded, 0.0f);
        return 0.0f;
    }
    vmx = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded; t += 8) {
        const __m256 p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
        _mm256_storeu_ps(s + t, p);
        sum = _mm256_add_ps(sum, p);
    }
    return hsum(sum) + (sink == -INFINITY ? 0.0f : std::exp(sink - mx));
}

struct Extras {
    int64_t window;        // 0: none
    float softcap;         // 0: none
    const float* sinks;    // [heads] or null
};

// Rows [r0, r0 + nr) of one sequence; row r = query (r / heads), head (r % heads). Rows of one
// query and KV head are consecutive: they are scored and accumulated together, up to 4 at once.
// Two passes over the context: every key's score (K blocks, in table order), one exact softmax
// per row, then the weighted V rows (V blocks, in table order); the blocks kAhead ahead in that
// stream (K blocks, then V blocks) are prefetched a share per group while one is computed on.
void attend_rows(const Layer& L, const int32_t* table, int64_t context, int64_t heads,
                 int64_t qpk, int64_t r0, int nr, const float* q, int64_t q_st, int64_t q_sh,
                 int64_t q_row0, float* out, int64_t o_st, int64_t o_sh, float scale,
                 const Extras& x, float* acc, float* qbuf, std::vector<float>& sbuf) {
    const int64_t D = L.head_dim, bs = L.block_size;
    int64_t limit[kMaxRows], lo[kMaxRows], koff[kMaxRows];
    int64_t kv_end = 0, kv_start = INT64_MAX;
    for (int r = 0; r < nr; ++r) {
        const int64_t j = (r0 + r) / heads, h = (r0 + r) % heads;
        koff[r] = (h / qpk) * L.stride_h;
        const float* src = q + (q_row0 + j) * q_st + h * q_sh;
        for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * scale;
        limit[r] = context + j + 1;                   // keys [lo, limit) are visible
        lo[r] = x.window > 0 ? std::max<int64_t>(limit[r] - x.window, 0) : 0;
        kv_end = std::max(kv_end, limit[r]);
        kv_start = std::min(kv_start, lo[r]);
        std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    }
    const int64_t first = kv_start / bs;              // blocks before every row's window: unread
    int group_start[kMaxRows + 1], groups = 0;         // runs of <= 4 rows sharing koff
    for (int r = 0; r < nr; ++r)
        if (r == 0 || koff[r] != koff[r - 1] || r - group_start[groups - 1] == 4)
            group_start[groups++] = r;
    group_start[groups] = nr;
    const int64_t nblocks = (kv_end + bs - 1) / bs;
    const int64_t padded = (nblocks * bs + 7) / 8 * 8;
    if (static_cast<int64_t>(sbuf.size()) < nr * padded) sbuf.resize(nr * padded);
    float* s = sbuf.data();
    const int64_t block_bytes = bs * L.stride_s * static_cast<int64_t>(sizeof(float));
    const int64_t share = (block_bytes / groups + 63) / 64 * 64;
    // block i of the stream: K block first + i, then V block first + i - used, then nothing
    const int64_t used = nblocks - first;
    auto stream_block = [&](int64_t i) -> const float* {
        if (i >= 2 * used) return nullptr;
        const float* base = i < used ? L.k : L.v;
        return base + static_cast<int64_t>(table[first + i % used]) * L.stride_b;
    };
    for (int64_t i = 0; i < std::min<int64_t>(kAhead, 2 * used); ++i)
        prefetch(stream_block(i), 0, block_bytes);
    for (int64_t b = first; b < nblocks; ++b) {
        const int64_t start = b * bs, n = std::min(bs, kv_end - start);
        const float* kb = L.k + static_cast<int64_t>(table[b]) * L.stride_b;
        const float* ahead = stream_block(b - first + kAhead);
        for (int g = 0; g < groups; ++g) {
            const int r = group_start[g];
            by_width(group_start[g + 1] - r, [&](auto w) {
                score<decltype(w)::value>(qbuf + r * D, kb + koff[r], L.stride_s, n, D,
                                          s + r * padded + start, padded);
            });
            if (ahead) prefetch(ahead, g * share, std::min(block_bytes, (g + 1) * share));
        }
    }
    float inv[kMaxRows];
    for (int r = 0; r < nr; ++r) {
        const float sink = x.sinks ? x.sinks[(r0 + r) % heads] : -INFINITY;
        const float l = softmax_row(s + r * padded, lo[r], limit[r], padded, x.softcap, sink);
        inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    for (int64_t b = first; b < nblocks; ++b) {
        const int64_t start = b * bs, n = std::min(bs, kv_end - start);
        const float* vb = L.v + static_cast<int64_t>(table[b]) * L.stride_b;
        const float* ahead = stream_block(used + b - first + kAhead);
        for (int g = 0; g < groups; ++g) {
            const int r = group_start[g];
            by_width(group_start[g + 1] - r, [&](auto w) {
                accumulate<decltype(w)::value>(acc + r * D, vb + koff[r], L.stride_s, n, D,
                                               s + r * padded + start, padded);
            });
            if (ahead) prefetch(ahead, g * share, std::min(block_bytes, (g + 1) * share));
        }
    }
    for (int r = 0; r < nr; ++r) {
        const int64_t j = (r0 + r) / heads, h = (r0 + r) % heads;
        float* dst = out + (q_row0 + j) * o_st + h * o_sh;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv[r];
    }
}

}  // namespace

extern "C" {

int pdserve_attention_max_block() { return kMaxBlock; }

// Returns 0, or -1 when a shape is not supported (head_dim % 8, block_size > kMaxBlock).
int pdserve_paged_attention(const float* q, int64_t q_st, int64_t q_sh, const float* k,
                            const float* v, int64_t kv_sb, int64_t kv_ss, int64_t kv_sh,
                            const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                            const int32_t* q_start, const int32_t* q_lens, int64_t num_seqs,
                            float* out, int64_t o_st, int64_t o_sh, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, int threads, int64_t window, float softcap,
                            const float* sinks) {
    if (head_dim % 8 || block_size > kMaxBlock || block_size < 1 || num_heads % num_kv_heads)
        return -1;
    const Layer L{k, v, kv_sb, kv_ss, kv_sh, block_size, head_dim};
    const Extras x{window, softcap, sinks};
    const int64_t qpk = num_heads / num_kv_heads;
    // tasks: (sequence, run of rows); starts[i] = the first task of sequence i
    std::vector<int64_t> starts(num_seqs + 1, 0);
    for (int64_t i = 0; i < num_seqs; ++i)
        starts[i + 1] = starts[i] + (q_lens[i] * num_heads + kMaxRows - 1) / kMaxRows;
    const int64_t tasks = starts[num_seqs];
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> acc(kMaxRows * head_dim), qbuf(kMaxRows * head_dim), sbuf;
        int64_t i = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            while (starts[i + 1] <= task) ++i;         // tasks come in increasing order
            while (starts[i] > task) --i;
            const int64_t rows = static_cast<int64_t>(q_lens[i]) * num_heads;
            const int64_t r0 = (task - starts[i]) * kMaxRows;
            const int nr = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
            attend_rows(L, tables + i * table_stride, seq_lens[i] - q_lens[i], num_heads, qpk,
                        r0, nr, q, q_st, q_sh, q_start[i], out, o_st, o_sh, scale, x,
                        acc.data(), qbuf.data(), sbuf);
        }
    }
    return 0;
}

}  // extern "C"
