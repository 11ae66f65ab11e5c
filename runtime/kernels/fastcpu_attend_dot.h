// Decode attention kernels in dot-product instructions: bf16 pools (vdpbf16ps) and int8 pools (vpdpwssd), each
// built where the compiler targets the instructions. The portable kernel and the dispatch are in
// fastcpu_attention.cpp.
#pragma once

#include "fastcpu_attend.h"

namespace fastcpu::attend {

#if defined(FASTCPU_BF16_DOT) || defined(FASTCPU_VNNI)
// Softmax over one range's scores, for G heads at once: s[g][0 .. n) holds head g's scaled scores of the range's
// positions (row stride kRange); head g sees its first ng = clamp(hi[g] - j0, 0, n). Writes each head's max m[g]
// and sum l[g] of exp(s - m), and overwrites s[g] with those weights, 0 past ng up to the next multiple of kTile.
//
// Why per range and not per tile (online softmax): the scores of a range are all known before its values are
// read, so one max per head replaces a running max with its corrections, and the exps of a range are independent
// of each other. Per tile, each head's max, exp and sum formed a chain of dependent reductions that the core
// waited on 16 positions at a time: a quarter of the int8 kernel's time with its KV in cache.
inline void softmax_range(float (*s)[kRange], int64_t group, int64_t n, int64_t j0, const int64_t* hi, float* m,
                          float* l) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t padded = (n + kTile - 1) / kTile * kTile;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t ng = std::clamp<int64_t>(hi[g] - j0, 0, n);
    if (ng == 0) {  // the range is past this head's token: no weights
      m[g] = -INFINITY;
      l[g] = 0.f;
      std::fill(s[g], s[g] + padded, 0.f);
      continue;
    }
    v16 vmax = splat(-INFINITY);
    for (int64_t t = 0; t < ng; t += kTile) {
      const v16i seen = lane < static_cast<int32_t>(ng - t);
      vmax = seen ? (load(&s[g][t]) > vmax ? load(&s[g][t]) : vmax) : vmax;
    }
    float mx = vmax[0];
    for (int i = 1; i < 16; ++i) mx = std::max(mx, vmax[i]);
    v16 vsum = splat(0.f);
    for (int64_t t = 0; t < padded; t += kTile) {
      const v16i seen = lane < static_cast<int32_t>(ng - t);
      const v16 p = seen ? exp16(load(&s[g][t]) - splat(mx)) : splat(0.f);
      store(&s[g][t], p);
      vsum += p;
    }
    float sum = 0.f;
    for (int i = 0; i < 16; ++i) sum += vsum[i];
    m[g] = mx;
    l[g] = sum;
  }
}
// The even- and odd-position accumulators of a range's value sums, all zero.
template <int G, int NC>
inline void zero_accumulators(__m512 (&even)[G][NC], __m512 (&odd)[G][NC]) {
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) even[g][c] = odd[g][c] = _mm512_setzero_ps();
}
#endif

#ifdef FASTCPU_BF16_DOT
// attend_range over a bf16 pool for bf16 queries (exact in bf16), with the arithmetic in bf16 dot products
// (vdpbf16ps: pairs of products summed in fp32) instead of widening every K and V element to fp32 first: the
// scores over pairs of dims, the values over pairs of positions with the weights rounded to bf16, as the extend
// kernel's. About a third fewer vector instructions per position, which is what bounds a decode step's
// attention once its KV is in cache (30 layers, one 1k-token row: 1.04 -> 0.69 ms; 8 rows 7.1 -> 4.4 ms; read
// from memory the kernel is bound by it and gains far less). Against float64 its mean error is 1.1-1.6x that of
// rounding the exact result to bf16 (the fp32 path's: 1.0x); the tests bound it at 2x.
template <int G, int NV>
void attend_range_bf16(const float* q, int64_t, int64_t d, const at::BFloat16* k_pool, const at::BFloat16* v_pool,
                       int64_t slot_stride, int64_t head_off, const int64_t* slots, int64_t j0, int64_t j1,
                       float scale, const int64_t* hi, float* m_out, float* l_out, float* acc_out) {
  constexpr int NC = NV / 2;  // 32-element chunks of a head's row
  const int64_t pf_len = prefetch_length<at::BFloat16>(head_off, slot_stride, d);
  __m512bh qv[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c)
      qv[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * d + c * 32 + 16), _mm512_loadu_ps(q + g * d + c * 32));
  // Every score of the range first, then one softmax per head over the range (softmax_range), then the values:
  // an online softmax per 16-position tile made each head's max, exp and sum a chain of dependent reductions
  // the core waited on, and rescaled the accumulators whenever the max moved.
  alignas(64) float s[G][kRange];
  for (int64_t j = j0; j < j1; j += kTile) {
    const int64_t n = std::min<int64_t>(kTile, j1 - j);
    v16 dp[G][kTile];
    for (int64_t t = 0; t < kTile; ++t) {
      if (t >= n) {
        for (int g = 0; g < G; ++g) dp[g][t] = splat(0.f);
        continue;
      }
      const at::BFloat16* kr = k_pool + slots[j + t] * slot_stride + head_off;
      if (j + kPrefetch + t < j1) prefetch_row(k_pool + slots[j + kPrefetch + t] * slot_stride + head_off, pf_len);
      __m512bh kc[NC];
      for (int c = 0; c < NC; ++c) kc[c] = (__m512bh)_mm512_loadu_si512(kr + c * 32);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kc[0]);
        for (int c = 1; c < NC; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], kc[c]);
        dp[g][t] = (v16)a;
      }
    }
    for (int g = 0; g < G; ++g) store(&s[g][j - j0], hsum16(dp[g]) * splat(scale));
  }
  softmax_range(s, G, j1 - j0, j0, hi, m_out, l_out);
  __m512 acc_e[G][NC], acc_o[G][NC];
  zero_accumulators(acc_e, acc_o);
  for (int64_t j = j0; j < j1; j += kTile) {
    const int64_t n = std::min<int64_t>(kTile, j1 - j);
    // The weighted values as bf16 dot products over pairs of positions: weights rounded to bf16 (as the
    // extend kernel's), the two positions' value rows interleaved word by word (unpack within 128-bit lanes,
    // so the accumulators hold the dims in a permuted order, undone at the end).
    alignas(64) uint32_t pw[G][kTile / 2];
    for (int g = 0; g < G; ++g)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pw[g]),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&s[g][j - j0])));
    for (int64_t t = 0; t < n; t += 2) {
      const at::BFloat16* va = v_pool + slots[j + t] * slot_stride + head_off;
      if (j + kPrefetch + t < j1) prefetch_row(v_pool + slots[j + kPrefetch + t] * slot_stride + head_off, pf_len);
      if (j + kPrefetch + t + 1 < j1)
        prefetch_row(v_pool + slots[j + kPrefetch + t + 1] * slot_stride + head_off, pf_len);
      for (int c = 0; c < NC; ++c) {
        const __m512i a = _mm512_loadu_si512(va + c * 32);
        const __m512i b = t + 1 < n ? _mm512_loadu_si512(v_pool + slots[j + t + 1] * slot_stride + head_off + c * 32)
                                    : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi16 = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < G; ++g) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[g][t / 2]));
          acc_e[g][c] = _mm512_dpbf16_ps(acc_e[g][c], lo, p);
          acc_o[g][c] = _mm512_dpbf16_ps(acc_o[g][c], hi16, p);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) store_interleaved(acc_out + g * d + c * 32, acc_e[g][c], acc_o[g][c]);
}
#endif

#ifdef FASTCPU_VNNI
// int16 steps of max / 32767: the factor into them (0 for an all-zero max, whose values then round to 0), and 16
// values rounded to nearest even into them (saturating, though |x| <= max never exceeds 32767).
inline __m512 int16_steps(float max) { return _mm512_set1_ps(max > 0.f ? 32767.f / max : 0.f); }
inline __m256i to_int16(__m512 x, __m512 inv) {
  return _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x, inv)));
}

// A head's query as int16 for vpdpwssd: q * 32767 / max|q| rounded to nearest even, 32 values per vector in
// order; returns the factor back (max|q| / 32767; 0 for an all-zero query, whose vectors are then 0).
template <int NC>
inline float quantize_query(const float* q, __m512i (&out)[NC]) {
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < 2 * NC; ++i) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(q + 16 * i)));
  const float mx = _mm512_reduce_max_ps(amax);
  const __m512 inv = int16_steps(mx);
  for (int c = 0; c < NC; ++c) {
    const __m256i lo = to_int16(_mm512_loadu_ps(q + 32 * c), inv);
    const __m256i hi = to_int16(_mm512_loadu_ps(q + 32 * c + 16), inv);
    out[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  return mx / 32767.f;
}

// 32 int8 values of a row widened to int16.
inline __m512i widen(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// attend_range over an int8 pool with the arithmetic in integer dot products (vpdpwssd: pairs of int16 products
// summed into int32 lanes) instead of widening every K and V value to fp32: 8 vector instructions per K row and
// 10 per V row for three query heads, against 20 and 23. Each query head is quantised to int16 once per call,
// and each tile's weights (probability times the V row's scale) to int16 per head; the K and V values are exact
// as int16. The dot products are exact in int32 (a score sums d products of |q| <= 32767 and |k| <= 127; a tile's
// value sum 16 of |w| <= 32767 and |v| <= 127), so the only roundings besides the fp32 softmax are the two int16
// ones: 2^-16 of the head's largest query value and of the tile's largest weight, far below the int8 rows' own.
template <int G, int NV>
void attend_range_i8(const float* q, int64_t, int64_t d, const int8_t* k_pool, const int8_t* v_pool,
                     int64_t slot_stride, int64_t head_off, const int64_t* slots, int64_t j0, int64_t j1, float scale,
                     const int64_t* hi, float* m_out, float* l_out, float* acc_out) {
  constexpr int NC = NV / 2;  // 32-value chunks of a head's row
  const int64_t pf_len = prefetch_length<int8_t>(head_off, slot_stride, d);
  float q_scale[G];
  __m512i qv[G][NC];
  for (int g = 0; g < G; ++g) q_scale[g] = quantize_query<NC>(q + g * d, qv[g]) * scale;
  alignas(64) float s[G][kRange];
  for (int64_t j = j0; j < j1; j += kTile) {
    const int64_t n = std::min<int64_t>(kTile, j1 - j);
    alignas(64) float k_scale[kTile];
    v16i dp[G][kTile];
    for (int64_t t = 0; t < kTile; ++t) {
      if (t >= n) {
        for (int g = 0; g < G; ++g) dp[g][t] = v16i{};
        k_scale[t] = 0.f;
        continue;
      }
      const int8_t* kr = k_pool + slots[j + t] * slot_stride + head_off;
      if (j + kPrefetch + t < j1) prefetch_row(k_pool + slots[j + kPrefetch + t] * slot_stride + head_off, pf_len);
      k_scale[t] = row_scale(kr, d);
      __m512i kc[NC];
      for (int c = 0; c < NC; ++c) kc[c] = widen(kr + c * 32);
      for (int g = 0; g < G; ++g) {
        __m512i a = dpwssd(_mm512_setzero_si512(), qv[g][0], kc[0]);
        for (int c = 1; c < NC; ++c) a = dpwssd(a, qv[g][c], kc[c]);
        dp[g][t] = (v16i)a;
      }
    }
    const v16 ks = load(k_scale);
    for (int g = 0; g < G; ++g)
      store(&s[g][j - j0], __builtin_convertvector(hsum16(dp[g]), v16) * splat(q_scale[g]) * ks);
  }
  softmax_range(s, G, j1 - j0, j0, hi, m_out, l_out);
  __m512 acc_e[G][NC], acc_o[G][NC];
  zero_accumulators(acc_e, acc_o);
  for (int64_t j = j0; j < j1; j += kTile) {
    const int64_t n = std::min<int64_t>(kTile, j1 - j);
    // Each head's weights on the tile's int8 values: probability times the V row's scale, as int16 over the
    // tile's largest.
    alignas(64) float v_scale[kTile] = {};  // 0 past the tile's positions
    for (int64_t t = 0; t < n; ++t) v_scale[t] = row_scale(v_pool + slots[j + t] * slot_stride + head_off, d);
    alignas(64) uint32_t pw[G][kTile / 2];
    float w_scale[G];
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_mul_ps(_mm512_load_ps(&s[g][j - j0]), _mm512_load_ps(v_scale));
      const float w_max = _mm512_reduce_max_ps(w);
      w_scale[g] = w_max / 32767.f;
      _mm256_store_si256(reinterpret_cast<__m256i*>(pw[g]), to_int16(w, int16_steps(w_max)));
    }
    __m512i iacc_e[G][NC], iacc_o[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) iacc_e[g][c] = iacc_o[g][c] = _mm512_setzero_si512();
    for (int64_t t = 0; t < n; t += 2) {
      const int8_t* va = v_pool + slots[j + t] * slot_stride + head_off;
      if (j + kPrefetch + t < j1) prefetch_row(v_pool + slots[j + kPrefetch + t] * slot_stride + head_off, pf_len);
      if (j + kPrefetch + t + 1 < j1)
        prefetch_row(v_pool + slots[j + kPrefetch + t + 1] * slot_stride + head_off, pf_len);
      const int8_t* vb = t + 1 < n ? v_pool + slots[j + t + 1] * slot_stride + head_off : nullptr;
      for (int c = 0; c < NC; ++c) {
        const __m512i a = widen(va + c * 32);
        const __m512i b = vb ? widen(vb + c * 32) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi16 = _mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < G; ++g) {
          const __m512i p = _mm512_set1_epi32(static_cast<int>(pw[g][t / 2]));
          iacc_e[g][c] = dpwssd(iacc_e[g][c], lo, p);
          iacc_o[g][c] = dpwssd(iacc_o[g][c], hi16, p);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 ws = _mm512_set1_ps(w_scale[g]);
      for (int c = 0; c < NC; ++c) {
        acc_e[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc_e[g][c]), ws, acc_e[g][c]);
        acc_o[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc_o[g][c]), ws, acc_o[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) store_interleaved(acc_out + g * d + c * 32, acc_e[g][c], acc_o[g][c]);
}
#endif

}  // namespace fastcpu::attend
