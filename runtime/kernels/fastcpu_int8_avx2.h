// linear_int8's register tiles for CPUs without AVX512-VNNI (AVX2): the same packed weights, the same quantised
// activations, the same int32 sums per block and the same fp32 fold as the VNNI tiles (fastcpu_int8.cpp), so a
// product has the same bits on either kind of CPU.
//
// Why: without integer dot products, int8 weights went through linear_packed, which widens every weight to fp32
// (two conversions per 8 weights besides the FMA) and multiplies in fp32: on a 2-core Zen 3 host an int8 prefill
// was slower than an fp32 one. Here 32 weight bytes (8 columns x 4 k) take, per activation row, one vpsignb, one
// vpmaddubsw (unsigned x signed bytes, pairs summed into int16), one vpmaddwd (int16 pairs into int32) and one
// vpaddd: 32 multiply-adds in two multiplier operations, against four FMAs for 32 in fp32.
//
// Exactness: vpmaddubsw saturates its int16 pair sums, so the operands must keep them below 2^15. The packed
// weights are w + 128 (vpdpbusd's unsigned side); flipped back (xor 0x80) they are w, |w| <= 127, and the
// activations q have |q| <= 127. The unsigned operand is |q| (broadcast per row) and the signed one w * sign(q)
// (vpsignb), so each pair sums at most 2 * 127 * 127 = 32,258: no saturation, and vpmaddwd's int32 sums are the
// exact sum_k w_k q_k of each group. A block's sum plus 128 * sum(q) is the VNNI tiles' sum_k (w_k + 128) q_k, and
// from there the fold and the final correction are the VNNI tiles' own steps.
//
// Registers: AVX2 has 16. A tile keeps MR x NV integer accumulators, each row's broadcast and its magnitude, and
// one weight vector at a time; the fp32 accumulators are folded into once per block (32 k) and may live in L1.
#pragma once

#include "fastcpu_int8.h"

namespace fastcpu::int8 {

#if defined(FASTCPU_INT8_DOT) && !defined(FASTCPU_VNNI)

constexpr int kLanes = 8;  // columns per vector
// One row takes the whole panel (8 accumulators), two rows half of it per pass (8).
constexpr int64_t kTileRows = 2;
constexpr int tile_passes(int64_t rows) { return rows == 1 ? 1 : 2; }

// MR rows x NV vectors (8 columns each) of one panel, from column c0 of the panel.
template <int MR, int NV, typename Fetch>
inline void tile(const QuantRows& xq, int64_t r0, int64_t groups, const uint8_t* panel, int64_t c0,
                 const fastcpu::ProductDest& out, int64_t cn, const float* scale, const float* bias,
                 const Fetch& fetch) {
  __m256 facc[MR][NV];
  for (int a = 0; a < MR; ++a)
    for (int v = 0; v < NV; ++v) facc[a][v] = _mm256_setzero_ps();
  const int64_t block_groups = xq.block / 4;
  const int8_t* xrow[MR];
  for (int a = 0; a < MR; ++a) xrow[a] = xq.q.data() + (r0 + a) * xq.ld;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < xq.nb; ++b) {
    __m256i iacc[MR][NV];
    for (int a = 0; a < MR; ++a)
      for (int v = 0; v < NV; ++v) iacc[a][v] = _mm256_setzero_si256();
    const int64_t g1 = std::min(groups, (b + 1) * block_groups);
    for (int64_t g = b * block_groups; g < g1; ++g) {
      const uint8_t* wg = panel + g * kGroupBytes + c0 * 4;
      fetch.at(g);
      __m256i xb[MR], mag[MR];
      for (int a = 0; a < MR; ++a) {
        int32_t four;
        std::memcpy(&four, xrow[a] + 4 * g, 4);
        xb[a] = _mm256_set1_epi32(four);
        mag[a] = _mm256_abs_epi8(xb[a]);
      }
      // one weight vector at a time, for every row: fewer registers live than all NV weights at once (GCC kept
      // some accumulators on the stack with those)
      for (int v = 0; v < NV; ++v) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * v)), flip);
        for (int a = 0; a < MR; ++a) {
          const __m256i pairs = _mm256_maddubs_epi16(mag[a], _mm256_sign_epi8(w, xb[a]));
          iacc[a][v] = _mm256_add_epi32(iacc[a][v], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int a = 0; a < MR; ++a) {
      const __m256 s = _mm256_set1_ps(xq.scale[(r0 + a) * xq.nb + b]);
      const __m256i offset = _mm256_set1_epi32(128 * xq.qsum[(r0 + a) * xq.nb + b]);
      for (int v = 0; v < NV; ++v)
        facc[a][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(iacc[a][v], offset)), s, facc[a][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t col = c0 + kLanes * v, left = cn - col;
    if (left <= 0) break;
    const __m256 sc = load8_tail(scale + col, left);
    const __m256 bi = bias ? load8_tail(bias + col, left) : _mm256_setzero_ps();
    for (int a = 0; a < MR; ++a)
      out.store8(a, col, _mm256_fmadd_ps(_mm256_sub_ps(facc[a][v], _mm256_set1_ps(xq.corr[r0 + a])), sc, bi),
                 std::min<int64_t>(kLanes, left));
  }
}

#endif

}  // namespace fastcpu::int8
