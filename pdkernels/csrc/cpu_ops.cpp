// Two of the decoder layer's small fp32 operations for x86 CPUs with AVX2 and FMA, each one pass over
// its rows instead of the several torch ops (and their temporaries) of the reference:
//
// - RMSNorm, optionally after the residual add: s = x + residual; y = w * (s * r) with
//   r = 1 / sqrt(mean(s^2) + eps), as HF computes it (engine/layers/norm.py), the mean summed
//   in 8 lanes (not torch's order: the last bits of r may differ).
// - Rotary embeddings (rotate-half layout) in place on q and k: x1' = x1 * c1 - x2 * s1,
//   x2' = x2 * c2 + x1 * s2, the products rounded before the sum as torch does (built with
//   -ffp-contract=off: no fused multiply-adds), so the same bits as the torch reference.
//
// Plain C ABI, loaded with ctypes by pdkernels/cpu_ops.py; rows split over OpenMP threads when
// there are enough of them.

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

inline float lane_sum(__m256 v) {   // the 8 lanes, pairwise
    alignas(32) float l[8];
    _mm256_store_ps(l, v);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

void rms_norm_row(const float* x, const float* res, float* y, float* res_out, const float* w,
                  int64_t dim, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    float tail = 0.0f;
    const float* s = x;
    if (res) {     // s = x + residual, kept for the next layer
        for (i = 0; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(res + i));
            _mm256_storeu_ps(res_out + i, v);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        for (; i < dim; ++i) {
            res_out[i] = x[i] + res[i];
            tail += res_out[i] * res_out[i];
        }
        s = res_out;
    } else {
        for (i = 0; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        for (; i < dim; ++i) tail += x[i] * x[i];
    }
    const float mean = (lane_sum(acc) + tail) / static_cast<float>(dim);
    const float r = 1.0f / std::sqrt(mean + eps);
    const __m256 rv = _mm256_set1_ps(r);
    for (i = 0; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(s + i), rv)));
    for (; i < dim; ++i) y[i] = w[i] * (s[i] * r);
}

}  // namespace

extern "C" {

// y[rows, dim] = RMSNorm(x (+ residual)) * w; with residual (may be null), res_out gets
// x + residual. Rows are contiguous, `ld*` their strides in floats.
void pdserve_rms_norm(const float* x, int64_t ldx, const float* res, int64_t ldr, float* y,
                      int64_t ldy, float* res_out, int64_t ldo, const float* w, int64_t rows,
                      int64_t dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 64)
    for (int64_t r = 0; r < rows; ++r)
        rms_norm_row(x + r * ldx, res ? res + r * ldr : nullptr, y + r * ldy,
                     res ? res_out + r * ldo : nullptr, w, dim, eps);
}

// Rotary embeddings in place: x[t, h, :] for heads h < heads, token rows `ldt` floats apart,
// heads `ldh` apart; cos, sin [tokens, dim] contiguous (cat(freqs, freqs) layout).
void pdserve_rotary(float* x, int64_t ldt, int64_t ldh, int64_t tokens, int64_t heads,
                    const float* cos, const float* sin, int64_t dim, int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tokens >= 64)
    for (int64_t t = 0; t < tokens; ++t) {
        const float* c = cos + t * dim;
        const float* s = sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            float* x1 = x + t * ldt + h * ldh;
            float* x2 = x1 + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
                _mm256_storeu_ps(x1 + i, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                       _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
                _mm256_storeu_ps(x2 + i, _mm256_add_ps(
                    _mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                    _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
            }
            for (; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}
}  // extern "C"
