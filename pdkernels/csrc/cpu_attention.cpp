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
// block is read whole, in address order, while the next one is prefetched (a block per KV head
// would read a third of each block's lines per pass and leave the prefetcher nothing to follow,
// several times slower: docs/performance.md, "CPU attention"). For each KV block: scores of
// every row against its keys, then an online softmax in fp32 (running max and sum per row) and
// the weighted V rows added into the row accumulators. exp is a vectorized Cephes-style
// polynomial (relative error ~2e-7); masked keys contribute exactly 0.
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
constexpr int kMaxBlock = 64;    // largest block_size handled (scores of one block per row)

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

inline void prefetch(const float* p, int64_t bytes) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Scores of N rows that share a KV head (queries qb[i * D ..], pre-scaled) against the n keys of
// one block: each key row is loaded once for the N rows, N independent FMA chains.
template <int N>
inline void score(const float* qb, const float* kb, int64_t stride_s, int64_t n, int64_t D,
                  float (*s)[kMaxBlock], const int64_t* limit, int64_t start) {
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {                 // two keys at a time: 2N independent chains
        const float* k0 = kb + t * stride_s;
        const float* k1 = k0 + stride_s;
        __m256 a[N], b[N];
        for (int i = 0; i < N; ++i) a[i] = b[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
            for (int i = 0; i < N; ++i) {
                const __m256 qv = _mm256_loadu_ps(qb + i * D + d);
                a[i] = _mm256_fmadd_ps(qv, x0, a[i]);
                b[i] = _mm256_fmadd_ps(qv, x1, b[i]);
            }
        }
        for (int i = 0; i < N; ++i) {
            s[i][t] = start + t < limit[i] ? hsum(a[i]) : -INFINITY;
            s[i][t + 1] = start + t + 1 < limit[i] ? hsum(b[i]) : -INFINITY;
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
        for (int i = 0; i < N; ++i) s[i][t] = start + t < limit[i] ? hsum(a[i]) : -INFINITY;
    }
}

// acc[i] += sum_t p[i][t] * v[t] for N rows sharing a KV head, 8 columns at a time held in
// registers across the block's keys (each V row loaded once for the N rows).
template <int N>
inline void accumulate(float* acc, const float* vb, int64_t stride_s, int64_t n, int64_t D,
                       float (*p)[kMaxBlock]) {
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {              // two column chunks: 2N independent chains
        __m256 a[N], b[N];
        for (int i = 0; i < N; ++i) {
            a[i] = _mm256_loadu_ps(acc + i * D + d);
            b[i] = _mm256_loadu_ps(acc + i * D + d + 8);
        }
        for (int64_t t = 0; t < n; ++t) {
            const __m256 v0 = _mm256_loadu_ps(vb + t * stride_s + d);
            const __m256 v1 = _mm256_loadu_ps(vb + t * stride_s + d + 8);
            for (int i = 0; i < N; ++i) {
                const __m256 w = _mm256_set1_ps(p[i][t]);
                a[i] = _mm256_fmadd_ps(w, v0, a[i]);
                b[i] = _mm256_fmadd_ps(w, v1, b[i]);
            }
        }
        for (int i = 0; i < N; ++i) {
            _mm256_storeu_ps(acc + i * D + d, a[i]);
            _mm256_storeu_ps(acc + i * D + d + 8, b[i]);
        }
    }
    for (; d < D; d += 8) {
        __m256 a[N];
        for (int i = 0; i < N; ++i) a[i] = _mm256_loadu_ps(acc + i * D + d);
        for (int64_t t = 0; t < n; ++t) {
            const __m256 v = _mm256_loadu_ps(vb + t * stride_s + d);
            for (int i = 0; i < N; ++i) a[i] = _mm256_fmadd_ps(_mm256_set1_ps(p[i][t]), v, a[i]);
        }
        for (int i = 0; i < N; ++i) _mm256_storeu_ps(acc + i * D + d, a[i]);
    }
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

// Online softmax update of one row for a block's scores s[0..n): rescales the row's
// accumulator, leaves the weights exp(s - max) in s.
inline void softmax_block(float* s, int64_t n, float& m, float& l, float* acc, int64_t D) {
    float mx = m;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
    if (mx == -INFINITY) {                      // nothing visible yet for this row
        for (int64_t t = 0; t < n; ++t) s[t] = 0.0f;
        return;
    }
    const float alpha = m == -INFINITY ? 0.0f : std::exp(m - mx);
    m = mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
        _mm256_storeu_ps(s + t, p);
        sum = _mm256_add_ps(sum, p);
    }
    float total = hsum(sum);
    for (; t < n; ++t) {
        s[t] = s[t] == -INFINITY ? 0.0f : std::exp(s[t] - mx);
        total += s[t];
    }
    l = l * alpha + total;
    if (alpha != 1.0f) {
        const __m256 va = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), va));
    }
}

// Rows [r0, r0 + nr) of one sequence; row r = query (r / heads), head (r % heads). Rows of one
// query and KV head are consecutive: they are scored and accumulated together, up to 4 at once.
void attend_rows(const Layer& L, const int32_t* table, int64_t context, int64_t heads,
                 int64_t qpk, int64_t r0, int nr, const float* q, int64_t q_st, int64_t q_sh,
                 int64_t q_row0, float* out, int64_t o_st, int64_t o_sh, float scale,
                 float* acc, float* qbuf) {
    const int64_t D = L.head_dim, bs = L.block_size;
    int64_t limit[kMaxRows], koff[kMaxRows];
    float m[kMaxRows], l[kMaxRows];
    int64_t kv_end = 0;
    for (int r = 0; r < nr; ++r) {
        const int64_t j = (r0 + r) / heads, h = (r0 + r) % heads;
        koff[r] = (h / qpk) * L.stride_h;
        const float* src = q + (q_row0 + j) * q_st + h * q_sh;
        for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * scale;
        limit[r] = context + j + 1;                   // keys [0, limit) are visible
        kv_end = std::max(kv_end, limit[r]);
        m[r] = -INFINITY;
        l[r] = 0.0f;
        std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    }
    int group_start[kMaxRows + 1], groups = 0;         // runs of <= 4 rows sharing koff, limit
    for (int r = 0; r < nr; ++r)
        if (r == 0 || koff[r] != koff[r - 1] || limit[r] != limit[r - 1] ||
            r - group_start[groups - 1] == 4)
            group_start[groups++] = r;
    group_start[groups] = nr;
    alignas(32) float s[kMaxRows][kMaxBlock];
    const int64_t block_bytes = bs * L.stride_s * static_cast<int64_t>(sizeof(float));
    for (int64_t start = 0; start < kv_end; start += bs) {
        const int64_t n = std::min(bs, kv_end - start);
        const int64_t base = static_cast<int64_t>(table[start / bs]) * L.stride_b;
        // the next block is prefetched a share per group while this one is scored (all of it
        // at once would fill the line buffers and stall the arithmetic behind it)
        const float* next_k = nullptr;
        const float* next_v = nullptr;
        int64_t share = 0;
        if (start + bs < kv_end) {
            const int64_t next = static_cast<int64_t>(table[start / bs + 1]) * L.stride_b;
            next_k = L.k + next;
            next_v = L.v + next;
            share = (block_bytes / 4 + groups - 1) / groups;      // floats per group
            share = (share + 15) / 16 * 16;                       // whole lines
        }
        for (int g = 0; g < groups; ++g) {
            const int r = group_start[g];
            by_width(group_start[g + 1] - r, [&](auto w) {
                score<decltype(w)::value>(qbuf + r * D, L.k + base + koff[r], L.stride_s, n, D,
                                          s + r, limit + r, start);
            });
            if (share) {
                const int64_t off = g * share;
                const int64_t len = std::min(share, block_bytes / 4 - off) * 4;
                if (len > 0) {
                    prefetch(next_k + off, len);
                    prefetch(next_v + off, len);
                }
            }
        }
        for (int r = 0; r < nr; ++r) softmax_block(s[r], n, m[r], l[r], acc + r * D, D);
        for (int g = 0; g < groups; ++g) {
            const int r = group_start[g];
            by_width(group_start[g + 1] - r, [&](auto w) {
                accumulate<decltype(w)::value>(acc + r * D, L.v + base + koff[r], L.stride_s, n,
                                               D, s + r);
            });
        }
    }
    for (int r = 0; r < nr; ++r) {
        const int64_t j = (r0 + r) / heads, h = (r0 + r) % heads;
        float* dst = out + (q_row0 + j) * o_st + h * o_sh;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
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
                            float scale, int threads) {
    if (head_dim % 8 || block_size > kMaxBlock || block_size < 1 || num_heads % num_kv_heads)
        return -1;
    const Layer L{k, v, kv_sb, kv_ss, kv_sh, block_size, head_dim};
    const int64_t qpk = num_heads / num_kv_heads;
    // tasks: (sequence, run of rows); starts[i] = the first task of sequence i
    std::vector<int64_t> starts(num_seqs + 1, 0);
    for (int64_t i = 0; i < num_seqs; ++i)
        starts[i + 1] = starts[i] + (q_lens[i] * num_heads + kMaxRows - 1) / kMaxRows;
    const int64_t tasks = starts[num_seqs];
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> acc(kMaxRows * head_dim), qbuf(kMaxRows * head_dim);
        int64_t i = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            while (starts[i + 1] <= task) ++i;         // tasks come in increasing order
            while (starts[i] > task) --i;
            const int64_t rows = static_cast<int64_t>(q_lens[i]) * num_heads;
            const int64_t r0 = (task - starts[i]) * kMaxRows;
            const int nr = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
            attend_rows(L, tables + i * table_stride, seq_lens[i] - q_lens[i], num_heads, qpk,
                        r0, nr, q, q_st, q_sh, q_start[i], out, o_st, o_sh, scale, acc.data(),
                        qbuf.data());
        }
    }
    return 0;
}

}  // extern "C"
