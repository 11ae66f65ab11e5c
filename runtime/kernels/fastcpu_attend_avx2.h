// Decode attention for CPUs without AVX-512 (AVX2 and FMA): the kernel pick_attend (fastcpu_attention.cpp) takes
// there for head dims 64 and 128, over fp32, bf16 and int8 pools alike.
//
// Why a kernel of its own: attend_range keeps a group's queries and accumulators in arrays of 16-float vectors.
// With AVX-512 those are registers (3 heads x 64 dims: 24 of the 32); without it each is two of AVX2's 16 ymm
// registers, and GCC keeps such arrays in memory, loading and storing them around every position: 8 rows of 1k
// positions, 30 layers of an fp32 pool, ran at 6.7 GB/s on a Zen 3 host. Here every loop fits in the 16 ymm
// registers: a range's scores are taken 8 positions at a time for one pass of heads at a time (the 8 K rows stay
// in L1 for the group's other heads), softmaxed per head over the range (softmax8), and the values summed 16
// positions at a time into each head's output row, the tile's V rows in L1 for every head: one head per pass over
// an fp32 pool (8 rows of scores, 64 dims of values), up to three over a converted pool (below).
// The dot-product kernels' softmax over a range (softmax_range, 16-float vectors) took 40% of this kernel's time on
// AVX2, as much as its scores and values together: softmax8 is the same steps in 8-float registers.
// Over an int8 or bf16 pool each K and V value is converted to fp32 before its FMA, so there up to three heads of the
// group take one pass over the rows (score_heads, sum_heads): a value is converted once for them, and the pass keeps
// 12 accumulator chains in flight instead of 8. On a Zen 3 host one KV head's ranges over an int8 pool took 0.82x the
// time per position (one core, rows in L2), the decode stack at batch 8 0.90x, at batch 1 about the same; over an
// fp32 pool, where the FMAs read the rows from memory operands, one head per pass stays faster. Either way each
// head's sums run in the same order, so the bits are the same.
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
  // whole vectors of seen scores first, without a mask; then the partial one, if any
  const int64_t whole = ng / 8 * 8;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < whole; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
  if (whole < ng)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + whole),
                                                first_lanes(ng - whole)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  const float mx = *std::max_element(lanes, lanes + 8);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    __m256 p = _mm256_setzero_ps();
    if (t < ng) {
      p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
      if (t >= whole) p = _mm256_and_ps(p, first_lanes(ng - t));
    }
    _mm256_storeu_ps(s + t, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  _mm256_store_ps(lanes, vsum);
  float sum = 0.f;
  for (float v : lanes) sum += v;
  *m = mx;
  *l = sum;
}

// Query heads per pass over a tile's rows: three where each value must be converted first (shared by the heads),
// one over an fp32 pool.
template <typename KV>
constexpr int kHeadsPerPass = std::is_same_v<KV, float> ? 1 : 3;

// The scores of HC heads (queries q + h * d) against the 8 rows into s[h * kRange ..] (lanes: rows), scaled by scale
// and an int8 row's k_scale. Each row's products are summed over the dims in order and then across the lanes (hsum8).
// One head takes the 8 rows at once, several 4 at a time (HC x 4 accumulators, each row's values converted once for
// every head).
template <int HC, typename KV, int NV>
inline void score_heads(const float* q, int64_t d, const KV* const* row, float scale, const float* k_scale, float* s) {
  constexpr int kRows = HC == 1 ? 8 : 4;
  __m256 dp[HC][8];
  for (int t0 = 0; t0 < 8; t0 += kRows) {
    __m256 acc[HC][kRows];
    for (int h = 0; h < HC; ++h)
      for (int t = 0; t < kRows; ++t) acc[h][t] = _mm256_setzero_ps();
    for (int c = 0; c < NV; ++c)
      for (int t = 0; t < kRows; ++t) {
        const __m256 k = load8(row[t0 + t] + 8 * c);
        for (int h = 0; h < HC; ++h) acc[h][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + 8 * c), k, acc[h][t]);
      }
    for (int h = 0; h < HC; ++h)
      for (int t = 0; t < kRows; ++t) dp[h][t0 + t] = acc[h][t];
  }
  for (int h = 0; h < HC; ++h) {
    __m256 sc = _mm256_mul_ps(hsum8(dp[h]), _mm256_set1_ps(scale));
    if constexpr (std::is_same_v<KV, int8_t>) sc = _mm256_mul_ps(sc, _mm256_load_ps(k_scale));
    _mm256_store_ps(s + h * kRange, sc);
  }
}

// out[h * d ..] += sum over the nt rows of w[h * ldw + t] * row t, for HC heads: one head 8 vectors (64 dims) per
// pass, several 4 each (HC x 4 accumulators, each row's values converted once for every head).
template <int HC, typename KV, int NV>
inline void sum_heads(const KV* const* row, int64_t nt, const float* w, int64_t ldw, int64_t d, float* out) {
  constexpr int kVecs = HC == 1 ? (NV < 8 ? NV : 8) : 4;
  for (int c0 = 0; c0 < NV; c0 += kVecs) {
    __m256 acc[HC][kVecs];
    for (int h = 0; h < HC; ++h)
      for (int c = 0; c < kVecs; ++c) acc[h][c] = _mm256_loadu_ps(out + h * d + 8 * (c0 + c));
    for (int64_t t = 0; t < nt; ++t) {
      __m256 wt[HC];
      for (int h = 0; h < HC; ++h) wt[h] = _mm256_broadcast_ss(w + h * ldw + t);
      for (int c = 0; c < kVecs; ++c) {
        const __m256 v = load8(row[t] + 8 * (c0 + c));
        for (int h = 0; h < HC; ++h) acc[h][c] = _mm256_fmadd_ps(wt[h], v, acc[h][c]);
      }
    }
    for (int h = 0; h < HC; ++h)
      for (int c = 0; c < kVecs; ++c) _mm256_storeu_ps(out + h * d + 8 * (c0 + c), acc[h][c]);
  }
}

// f(std::integral_constant<int, hc>, g0) for hc = min(kHeadsPerPass<KV>, group - g0) over g0 = 0, kHeadsPerPass<KV>, ...
template <typename KV, typename F>
inline void by_head_passes(int64_t group, F&& f) {
  constexpr int kPass = kHeadsPerPass<KV>;
  for (int64_t g0 = 0; g0 < group; g0 += kPass) {
    const int64_t hc = std::min<int64_t>(kPass, group - g0);
    if constexpr (kPass == 3) {
      if (hc == 3) {
        f(std::integral_constant<int, 3>{}, g0);
        continue;
      }
      if (hc == 2) {
        f(std::integral_constant<int, 2>{}, g0);
        continue;
      }
    }
    f(std::integral_constant<int, 1>{}, g0);
  }
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
  alignas(64) float s[kMaxCallHeads][kRange];
  alignas(64) float k_scale[kRange];
  const auto offset_of = [&](int64_t j) { return slots[j] * slot_stride + head_off; };  // position j's row, either pool
  int64_t offset[kRange];  // found in the scores' pass, read again in the values'
  const KV* row[kTile];
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    for (int64_t t = 0; t < 8; ++t) {  // positions past the range repeat its last row: their weights come out 0
      const int64_t j = j0 + std::min(t0 + t, n - 1);
      if (t0 + t < n) offset[t0 + t] = offset_of(j);
      row[t] = k_pool + offset[j - j0];
      if (t0 + t < n && j + kPrefetch < j1) prefetch_row(k_pool + offset_of(j + kPrefetch), pf_len);
      if constexpr (kInt8) k_scale[t0 + t] = row_scale(row[t], d);
    }
    by_head_passes<KV>(group, [&](auto heads, int64_t g0) {
      score_heads<decltype(heads)::value, KV, NV>(q + g0 * d, d, row, scale, k_scale + t0, &s[g0][t0]);
    });
  }
  for (int64_t g = 0; g < group; ++g) softmax8(s[g], n, std::clamp<int64_t>(hi[g] - j0, 0, n), m_out + g, l_out + g);
  std::fill(acc_out, acc_out + group * d, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t nt = std::min<int64_t>(kTile, n - t0);
    alignas(64) float v_scale[kTile] = {};  // 0 past the tile's rows, where the weights are 0 too
    for (int64_t t = 0; t < nt; ++t) {
      row[t] = v_pool + offset[t0 + t];
      if (t0 + t + kPrefetch < n) prefetch_row(v_pool + offset[t0 + t + kPrefetch], pf_len);
      v_scale[t] = row_scale(row[t], d);
    }
    // the weights: an int8 tile's with each row's scale in them (a whole tile's, 8 at a time), a float tile's the
    // probabilities themselves
    alignas(32) float scaled[kInt8 ? kMaxCallHeads : 1][kTile];
    if constexpr (kInt8)
      for (int64_t g = 0; g < group; ++g)
        for (int t = 0; t < kTile; t += 8)
          _mm256_store_ps(&scaled[g][t], _mm256_mul_ps(_mm256_load_ps(&s[g][t0 + t]), _mm256_load_ps(v_scale + t)));
    const float* w = kInt8 ? &scaled[0][0] : &s[0][t0];
    const int64_t ldw = kInt8 ? kTile : kRange;
    by_head_passes<KV>(group, [&](auto heads, int64_t g0) {
      sum_heads<decltype(heads)::value, KV, NV>(row, nt, w + g0 * ldw, ldw, d, acc_out + g0 * d);
    });
  }
}

#endif  // !__AVX512F__

}  // namespace fastcpu::attend
