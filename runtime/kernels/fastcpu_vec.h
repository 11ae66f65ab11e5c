// Helpers shared by the fastcpu kernels (fastcpu*.cpp): 16-float GCC vectors, loads that widen bf16 / int8 to
// fp32, stores that round to bf16 as torch does, transposed horizontal sums, a vectorised exp, and the checks
// of the linear kernels' optional bias and output.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Where the compiler targets AVX512_BF16 (-march=native on such a host), the bf16 dot-product kernels are built
// (linear_bf16, extend_attention); bf16_dot() tells at run time.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define FASTCPU_BF16_DOT 1
#endif

namespace fastcpu {

// The linear kernels' optional bias: float32 [n] (null when absent).
inline const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n, "bad bias");
  return bias->data_ptr<float>();
}

// The linear kernels' result: ``out`` when given (the product is added to it), else a new float32 [m, n].
inline torch::Tensor output_rows(const c10::optional<torch::Tensor>& out, const torch::Tensor& x, int64_t m,
                                 int64_t n) {
  if (!out.has_value()) return torch::empty({m, n}, x.options());
  TORCH_CHECK(out->scalar_type() == torch::kFloat32 && out->dim() == 2 && out->size(0) == m && out->size(1) == n &&
              out->stride(1) == 1, "out must be float32 [M, N] with contiguous rows");
  return *out;
}

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16 load(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  v16u w = __builtin_convertvector(h, v16u) << 16;
  v16 out;
  std::memcpy(&out, &w, sizeof(out));
  return out;
}

inline v16 load(const int8_t* p) {
  // Intrinsics: GCC scalarises __builtin_convertvector from int8 (a byte insert per lane).
#if defined(__AVX512F__)
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  v16 out;
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#endif
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

inline void store(at::BFloat16* p, v16 v) {  // round to nearest even, as torch's float -> bfloat16 cast
  v16u bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16;
  const v16h h = __builtin_convertvector(bits, v16h);
  std::memcpy(p, &h, sizeof(h));
}

// A float rounded through T and back: what storing an intermediate result in T does to it.
inline v16 round_to(v16 v, float*) { return v; }
inline v16 round_to(v16 v, at::BFloat16*) {
  alignas(64) at::BFloat16 tmp[16];
  store(tmp, v);
  return load(tmp);
}

// Transposed horizontal sums: out[t] = sum of the lanes of dp[t], t = 0..15, in four levels of pairwise
// shuffle-and-add (15 merges for 16 sums instead of 16 full reductions). Level w: each input vector holds
// 16/w sources of w partial lanes; a merge halves w and concatenates the sources of its two inputs.
inline v16 merge(v16 x, v16 y, v16i lo, v16i hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

inline v16 hsum16(const v16 (&dp)[16]) {
  const v16i lo16 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi16 = lo16 + 8;
  const v16i lo8 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i hi8 = lo8 + 4;
  const v16i lo4 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i hi4 = lo4 + 2;
  const v16i lo2 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i hi2 = lo2 + 1;
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = merge(dp[2 * i], dp[2 * i + 1], lo16, hi16);
  for (int i = 0; i < 4; ++i) b[i] = merge(a[2 * i], a[2 * i + 1], lo8, hi8);
  for (int i = 0; i < 2; ++i) c[i] = merge(b[2 * i], b[2 * i + 1], lo4, hi4);
  return merge(c[0], c[1], lo2, hi2);
}

// exp of 16 floats (Cephes' expf polynomial, ~1 ulp for |x| < 87); inputs below -87 give ~0.
inline v16 exp16(v16 x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  x = x > splat(88.3f) ? splat(88.3f) : x;
  v16 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v16i ti = __builtin_convertvector(fx, v16i);  // truncates toward zero
  v16 t = __builtin_convertvector(ti, v16);
  v16i over = t > fx;  // truncation went up (negative fx): floor is one less
  ti = ti + over;      // "true" lanes are -1
  t = __builtin_convertvector(ti, v16);
  x = x - t * splat(0.693359375f) - t * splat(-2.12194440e-4f);
  v16 y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * x * x + x + splat(1.0f);
  v16i pow2 = (ti + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &pow2, sizeof(scale));
  return y * scale;
}

#ifdef FASTCPU_BF16_DOT
// 32 floats -> 16 words of two bf16 each (values 2i and 2i + 1: vdpbf16ps's pair operand), rounded to nearest
// even. cvtne2ps puts its second operand in the low half.
inline void bf16_pairs32(const float* x, uint32_t* out) {
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
  _mm512_storeu_si512(out, (__m512i)v);
}
#endif

}  // namespace fastcpu
