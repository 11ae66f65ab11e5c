// What linear_int8's kernels share (fastcpu_int8.cpp: the AVX512-VNNI tiles; fastcpu_int8_avx2.h: the AVX2 tiles;
// fastcpu_int8_amx.h: the AMX tiles): the packed layout's sizes, the activation rows quantised per block, and the
// split of the work between threads.
//
// The quantisation is the same arithmetic on every CPU (a max, one multiply and a round to nearest even per value,
// an exact integer sum per block), so every kernel multiplies the same int8 activations. On AMX hosts a layer whose
// K is a multiple of 64 takes two-part activations instead (fastcpu_int8_split.h), at every batch size.
#pragma once

#include "fastcpu_ops.h"
#include "fastcpu_vec.h"

// Integer dot products for linear_int8: AVX512-VNNI (vpdpbusd), or AVX2's vpmaddubsw + vpmaddwd on CPUs without it.
#if defined(FASTCPU_VNNI) || defined(__AVX2__)
#define FASTCPU_INT8_DOT 1
#endif

namespace fastcpu::int8 {

#ifdef FASTCPU_INT8_DOT

constexpr int64_t kPanel = 64;
constexpr int64_t kGroupBytes = kPanel * 4;  // one k-group of a panel
constexpr int64_t kPrefetchGroups = 16;  // how far ahead (in k-groups, 256 bytes each) the weights are fetched

// The activations quantised per row and block: q [M, ld] int8 (zero past K), scale [M, nb], the exact sum of each
// block's q, qsum [M, nb], and each row's offset correction corr [M] = sum over its blocks of scale * 128 * qsum.
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> qsum;
  std::vector<float> corr;
  int64_t ld = 0, nb = 0, block = 0;
};

// 8 values from p (the first `left` of them, zero past them) widened to fp32: the AVX2 tiles' scales and bias, and
// the AVX2 quantisation's activations.
template <typename T>
inline __m256 load8_tail(const T* p, int64_t left) {
  if (left >= 8) return load8(p);
  T tail[8] = {};
  std::copy(p, p + left, tail);
  return load8(tail);
}

#ifdef FASTCPU_VNNI
inline __mmask16 first16(int64_t left) {
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}
// 16 activations (the lanes of `mask`, zero elsewhere) widened to fp32: bf16 exactly, by a 16-bit shift.
inline __m512 load_ps(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_ps(const at::BFloat16* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// max |x[i]| over i < n.
template <typename T>
inline float block_absmax(const T* x, int64_t n) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_ps(x + i, first16(n - i))));
  return _mm512_reduce_max_ps(amax);
}

// q[i] = round-half-even(x[i] * inv) for i < n; returns the sum of the q.
template <typename T>
inline int32_t block_quantize(const T* x, int64_t n, float inv, int8_t* q) {
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = first16(n - i);
    // cvtps rounds to nearest even (the default MXCSR mode); |x * inv| <= 127 up to rounding, so the
    // saturating narrow only guards against it.
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load_ps(x + i, mask), _mm512_set1_ps(inv)));
    sum = _mm512_add_epi32(sum, qi);
    _mm_mask_storeu_epi8(q + i, mask, _mm512_cvtsepi32_epi8(qi));
  }
  return _mm512_reduce_add_epi32(sum);
}
#else

template <typename T>
inline float block_absmax(const T* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load8_tail(x + i, n - i), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  return *std::max_element(lanes, lanes + 8);
}

template <typename T>
inline int32_t block_quantize(const T* x, int64_t n, float inv, int8_t* q) {
  __m256i sum = _mm256_setzero_si256();
  alignas(32) int32_t lanes[8];
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(load8_tail(x + i, n - i), _mm256_set1_ps(inv)));
    sum = _mm256_add_epi32(sum, qi);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), qi);
    for (int64_t j = 0; j < std::min<int64_t>(8, n - i); ++j)
      q[i + j] = static_cast<int8_t>(std::clamp<int32_t>(lanes[j], -128, 127));
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  int32_t total = 0;
  for (int32_t v : lanes) total += v;
  return total;
}
#endif

// Rows of x (float or bfloat16, read as they are: no fp32 copy first) quantised per block of `block` k values
// (symmetric: scale = max|x| / 127, q = round-half-even(x * 127 / max|x|)); rows in parallel when there are enough
// of them to pay for a parallel region (a prefill chunk's, not a decode batch's).
template <typename T>
QuantRows quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int64_t block) {
  QuantRows out;
  out.block = block;
  out.nb = (k + block - 1) / block;
  out.ld = out.nb * block;
  out.q.assign(m * out.ld, 0);
  out.scale.assign(m * out.nb, 0.f);
  out.qsum.assign(m * out.nb, 0);
  out.corr.assign(m, 0.f);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1));
  fastcpu::parallel_for(0, m, grain, [&](int64_t r_begin, int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      for (int64_t b = 0; b < out.nb; ++b) {
        const int64_t k0 = b * block, n = std::min(k, k0 + block) - k0;
        const float mx = block_absmax(x + r * ldx + k0, n);
        if (!(mx > 0.f)) continue;  // an all-zero block stays zero (scale 0)
        const int32_t sum = block_quantize(x + r * ldx + k0, n, 127.0f / mx, out.q.data() + r * out.ld + k0);
        out.scale[r * out.nb + b] = mx / 127.0f;
        out.qsum[r * out.nb + b] = sum;
        out.corr[r] += out.scale[r * out.nb + b] * static_cast<float>(128 * sum);
      }
    }
  });
  return out;
}

// items(i0, i1) over the work items (panel p, row chunk c) = p * chunks + c: with one chunk per panel (up to
// kInt8ChunkRows rows) the panels' split (parallel_panels), else at::parallel_for's, a panel's chunks together.
template <typename F>
void over_items(int64_t panels, int64_t chunks, const F& items) {
  if (chunks == 1) {
    fastcpu::parallel_panels(panels, items);
  } else {
    fastcpu::parallel_for(0, panels * chunks, 1, items);
  }
}

#endif  // FASTCPU_INT8_DOT

}  // namespace fastcpu::int8
