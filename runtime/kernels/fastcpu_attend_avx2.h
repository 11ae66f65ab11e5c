// Decode attention for CPUs without AVX-512 (AVX2 and FMA): the kernel pick_attend (fastcpu_attention.cpp) takes
// there for head dims 64 and 128, over fp32, bf16 and int8 pools alike.
//
// Why a kernel of its own: attend_range keeps a group's queries and accumulators in arrays of 16-float vectors.
// With AVX-512 those are registers (3 heads x 64 dims: 24 of the 32); without it each is two of AVX2's 16 ymm
// registers, and GCC keeps such arrays in memory, loading and storing them around every position: 8 rows of 1k
// positions, 30 layers of an fp32 pool, ran at 6.7 GB/s on a Zen 3 host. Here every loop holds at most ~11 ymm
// registers: a range's scores are taken 8 positions at a time for one head at a time (the 8 K rows stay in L1 for
// the group's other heads), softmaxed per head over the range (softmax8), and the values summed 16 positions at a
// time into each head's output row, 8 vectors (64 dims) per pass, the tile's V rows in L1 for every head.
// The dot-product kernels' softmax over a range (softmax_range, 16-float vectors) took 40% of this kernel's time on
// AVX2, as much as its scores and values together: softmax8 is the same steps in 8-float registers.
#pragma once

#include "fastcpu_attend.h"

namespace fastcpu::attend {

#ifndef __AVX512F__

// Transposed horizontal sums: lane t of the result is the sum of the lanes of x[t].
inline __m256 hsum8(const __m256 (&x)[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));  // per 128-bit half
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// e^x of 8 floats: exp16's arithmetic (exp_lanes, fastcpu_vec.h) in one AVX2 register.
inline __m256 exp8(__m256 x) { return (__m256)exp_lanes<v8, v8i>((v8)x); }

// Lanes below `count` of 8 (all of them from 8 on).
inline __m256 first_lanes(int64_t count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int c = static_cast<int>(std::min<int64_t>(count, 8));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), lane));
}

// softmax_range's contract (fastcpu_attend_dot.h) for one head: s[0 .. n) its scaled scores, of which it sees the
// first ng; writes its max and sum, and overwrites s with the weights, 0 from ng up to a whole tile.
inline void softmax8(float* s, int64_t n, int64_t ng, float* m, float* l) {
  const int64_t padded = (n + kTile - 1) / kTile * kTile;
  if (ng == 0) {
    *m = -INFINITY;
    *l = 0.f;
    std::fill(s, s + padded, 0.f);
    return;
  }
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < ng; t += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + t), first_lanes(ng - t)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  const float mx = *std::max_element(lanes, lanes + 8);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 p = t < ng ? _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(mx))),
                                            first_lanes(ng - t))
                            : _mm256_setzero_ps();
    _mm256_storeu_ps(s + t, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  _mm256_store_ps(lanes, vsum);
  float sum = 0.f;
  for (float v : lanes) sum += v;
  *m = mx;
  *l = sum;
}

// attend_range's contract (one KV head's range of positions j0..j1 <= j0 + kRange, `group` query heads, head g
// seeing positions below hi[g]; writes each head's max, sum and unnormalised output) for head dim 8 * NV. A head's
// arithmetic does not depend on the other heads of the call, so a token's result does not depend on its batch.
template <typename KV, int NV>
void attend_range_avx2(const float* q, int64_t group, int64_t d, const KV* k_pool, const KV* v_pool,
                       int64_t slot_stride, int64_t head_off, const int64_t* slots, int64_t j0, int64_t j1,
                       float scale, const int64_t* hi, float* m_out, float* l_out, float* acc_out) {
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  const int64_t n = j1 - j0, pf_len = prefetch_length<KV>(head_off, slot_stride, d);
  alignas(64) float s[kMaxGroup][kRange];
  alignas(64) float k_scale[kRange];
  const KV* row[kTile];
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    for (int64_t t = 0; t < 8; ++t) {  // positions past the range repeat its last row: their weights come out 0
      const int64_t j = j0 + std::min(t0 + t, n - 1);
      row[t] = k_pool + slots[j] * slot_stride + head_off;
      if (t0 + t < n && j + kPrefetch < j1) prefetch_row(k_pool + slots[j + kPrefetch] * slot_stride + head_off, pf_len);
      if constexpr (kInt8) k_scale[t0 + t] = row_scale(row[t], d);
    }
    for (int64_t g = 0; g < group; ++g) {
      __m256 dp[8];
      for (int t = 0; t < 8; ++t) dp[t] = _mm256_setzero_ps();
      for (int c = 0; c < NV; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + g * d + 8 * c);
        for (int t = 0; t < 8; ++t) dp[t] = _mm256_fmadd_ps(qc, load8(row[t] + 8 * c), dp[t]);
      }
      __m256 sc = _mm256_mul_ps(hsum8(dp), _mm256_set1_ps(scale));
      if constexpr (kInt8) sc = _mm256_mul_ps(sc, _mm256_load_ps(k_scale + t0));
      _mm256_store_ps(&s[g][t0], sc);
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax8(s[g], n, std::clamp<int64_t>(hi[g] - j0, 0, n), m_out + g, l_out + g);
  std::fill(acc_out, acc_out + group * d, 0.f);
  constexpr int kPass = NV < 8 ? NV : 8;  // output vectors per pass: 8 accumulators, a weight, a V value
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t nt = std::min<int64_t>(kTile, n - t0);
    alignas(64) float v_scale[kTile];
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t j = j0 + t0 + t;
      row[t] = v_pool + slots[j] * slot_stride + head_off;
      if (j + kPrefetch < j1) prefetch_row(v_pool + slots[j + kPrefetch] * slot_stride + head_off, pf_len);
      v_scale[t] = row_scale(row[t], d);
    }
    for (int64_t g = 0; g < group; ++g) {
      for (int c0 = 0; c0 < NV; c0 += kPass) {
        float* out = acc_out + g * d + 8 * c0;
        __m256 acc[kPass];
        for (int c = 0; c < kPass; ++c) acc[c] = _mm256_loadu_ps(out + 8 * c);
        for (int64_t t = 0; t < nt; ++t) {
          const __m256 w = _mm256_set1_ps(kInt8 ? s[g][t0 + t] * v_scale[t] : s[g][t0 + t]);
          for (int c = 0; c < kPass; ++c) acc[c] = _mm256_fmadd_ps(w, load8(row[t] + 8 * (c0 + c)), acc[c]);
        }
        for (int c = 0; c < kPass; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
      }
    }
  }
}

#endif  // !__AVX512F__

}  // namespace fastcpu::attend
