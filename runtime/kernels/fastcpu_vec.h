// Helpers shared by the fastcpu kernels (fastcpu*.cpp): 16-float GCC vectors, loads that widen bf16 / int8 to
// fp32, stores that round to bf16 as torch does, transposed horizontal sums, a vectorised exp, a work split by
// cost, and the linear kernels' activations in and out (float32 or bfloat16) and optional bias.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fastcpu_team.h"

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
// Where it targets AVX512-VNNI, the integer dot-product kernels are built (linear_int8, decode attention over an
// int8 KV pool); int8_vnni() tells at run time.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define FASTCPU_VNNI 1
#endif

namespace fastcpu {

#ifdef FASTCPU_VNNI
// acc + the dot products of a's and b's 4-byte (dpbusd: unsigned x signed bytes) or 2-word (dpwssd: int16 pairs)
// groups, accumulated in place. Written as asm because GCC 12 compiled the intrinsics' accumulator arrays in
// linear_int8's tiles into copies in and out of a second register set on every k-group (two vmovdqa per dot
// product); the "+v" operand keeps each accumulator in its register. Measured: 7-20% faster int8 linears from
// L2 at 8-169 rows (same instructions otherwise, so the same bits).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));  // one AVX2 register
typedef int32_t v8i __attribute__((vector_size(32)));
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

// 8 values widened to fp32 in one AVX2 register (bf16 exactly, by a 16-bit shift): the loads of the kernels for CPUs
// without AVX-512, whose 16-float vectors are two registers (fastcpu_attend_avx2.h, linear_packed's tiles).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

inline void store(at::BFloat16* p, v16 v) {  // round to nearest even, as torch's float -> bfloat16 cast
  v16u bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16;
  const v16h h = __builtin_convertvector(bits, v16h);
  std::memcpy(p, &h, sizeof(h));
}

// 8 floats into one AVX2 register's worth of memory: as is, or rounded to bf16 as store(at::BFloat16*, v16) rounds.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  // the 16-bit halves are the results (< 0x10000), so the unsigned saturating pack keeps them as they are
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

// A float rounded through T and back: what storing an intermediate result in T does to it.
inline v16 round_to(v16 v, float*) { return v; }
inline v16 round_to(v16 v, at::BFloat16*) {
  alignas(64) at::BFloat16 tmp[16];
  store(tmp, v);
  return load(tmp);
}
inline __m256 round8(__m256 v, float*) { return v; }
inline __m256 round8(__m256 v, at::BFloat16*) {
  alignas(32) at::BFloat16 tmp[8];
  store8(tmp, v);
  return load8(tmp);
}

// Transposed horizontal sums: out[t] = sum of the lanes of dp[t], t = 0..15, in four levels of pairwise
// shuffle-and-add (15 merges for 16 sums instead of 16 full reductions). Level w: each input vector holds
// 16/w sources of w partial lanes; a merge halves w and concatenates the sources of its two inputs.
// V: v16, or v16i for integer sums (exact where the float ones would round).
template <typename V>
inline V merge(V x, V y, v16i lo, v16i hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

template <typename V>
inline V hsum16(const V (&dp)[16]) {
  const v16i lo16 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi16 = lo16 + 8;
  const v16i lo8 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i hi8 = lo8 + 4;
  const v16i lo4 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i hi4 = lo4 + 2;
  const v16i lo2 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i hi2 = lo2 + 1;
  V a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = merge(dp[2 * i], dp[2 * i + 1], lo16, hi16);
  for (int i = 0; i < 4; ++i) b[i] = merge(a[2 * i], a[2 * i + 1], lo8, hi8);
  for (int i = 0; i < 2; ++i) c[i] = merge(b[2 * i], b[2 * i + 1], lo4, hi4);
  return merge(c[0], c[1], lo2, hi2);
}

// e^x lane by lane for a GCC float vector V (VI: the int32 vector of its width): Cephes' expf polynomial, ~1 ulp
// for |x| < 87; inputs below -87 give ~0. exp16 (16 floats) and exp8 (8 floats, one
// register) are this one function.
//
// x = n ln2 + r with n the integer nearest x log2(e), so e^x = 2^n e^r with |r| <= ln2 / 2 (e^r by the polynomial).
// With AVX-512, n comes from one vrndscaleps and 2^n is applied by one vscalefps: 13 instructions instead of 22 for
// every score of the attention kernels' softmaxes. The rounding of n differs from the portable
// floor(x log2(e) + 0.5) only at exact ties, so the two paths agree to the bit elsewhere.
template <typename V, typename VI>
inline V exp_lanes(V x) {
  const V zero = {};
  x = x < zero - 87.3f ? zero - 87.3f : x;
  x = x > zero + 88.3f ? zero + 88.3f : x;
  V t;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<V, v16>) {
    t = (v16)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else
#endif
  {
    const V fx = x * 1.44269504088896341f + 0.5f;
    VI ti = __builtin_convertvector(fx, VI);  // truncates toward zero
    t = __builtin_convertvector(ti, V);
    const VI over = t > fx;  // truncation went up (negative fx): floor is one less
    t = __builtin_convertvector(ti + over, V);  // "true" lanes are -1
  }
  x = x - t * 0.693359375f - t * -2.12194440e-4f;
  V y = zero + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<V, v16>) return (v16)_mm512_scalef_ps((__m512)y, (__m512)t);
#endif
  const VI pow2 = (__builtin_convertvector(t, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &pow2, sizeof(scale));
  return y * scale;
}

inline v16 exp16(v16 x) { return exp_lanes<v16, v16i>(x); }
// e^x of 8 floats: the same arithmetic in one AVX2 register.
inline __m256 exp8(__m256 x) { return (__m256)exp_lanes<v8, v8i>((v8)x); }

#ifdef FASTCPU_BF16_DOT
// 32 floats -> 16 words of two bf16 each (values 2i and 2i + 1: vdpbf16ps's pair operand), rounded to nearest
// even. cvtne2ps puts its second operand in the low half.
inline void bf16_pairs32(const float* x, uint32_t* out) {
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
  _mm512_storeu_si512(out, (__m512i)v);
}
#endif


// ------------------------------------------------------------------ work split by cost
// fn(begin, end) over the items [0, n) as at::parallel_for's, each thread taking one run of consecutive items of
// about the same total cost(item) (an item goes to the thread whose share holds its cost's midpoint).
// at::parallel_for splits by count, which left one thread with most of the work where items differ in size:
// a 1,065-token decode row's position ranges (256, 256, 256, 256, 41) went 3 + 2, i.e. 768 positions against
// 297; the blocks of a causal prefill grow with their position, so the second half of them cost 3x the first.
// Which thread runs an item does not change its arithmetic.
template <typename Cost, typename Fn>
inline void parallel_by_cost(int64_t n, const Cost& cost, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(fastcpu::num_threads(), n));
  std::vector<double> before(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) before[i + 1] = before[i] + static_cast<double>(cost(i));
  const double total = before[n];
  std::vector<int64_t> start(threads + 1, n);
  start[0] = 0;
  for (int64_t i = 0, t = 1; i < n && t < threads; ++i) {
    const double mid = total > 0 ? (before[i] + before[i + 1]) / 2 / total * threads : double(i) * threads / n;
    while (t < threads && mid >= t) start[t++] = i;
  }
  fastcpu::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (start[t] < start[t + 1]) fn(start[t], start[t + 1]);
  });
}

// fn(items, count) on each thread with the items of [0, n) dealt to it: the costliest first, each to the thread with
// the least cost so far; a thread runs its items in index order. Where a few items carry most of the work, runs of
// consecutive items cannot share them evenly: a decode batch of 8 rows under a shared ~1,050-position prefix has four
// items of 24 query heads over 256 positions and eight of one row's 3 heads over its own tail, and parallel_by_cost
// gave one thread two large items and the other two large items and all the small ones (the second thread took
// ~1.3x the first's time). Which thread runs an item does not change its arithmetic.
template <typename Cost, typename Fn>
inline void parallel_dealt_by_cost(int64_t n, const Cost& cost, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(fastcpu::num_threads(), n));
  std::vector<double> costs(n);
  for (int64_t i = 0; i < n; ++i) costs[i] = static_cast<double>(cost(i));
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::vector<double> load(threads, 0.0);
  std::vector<std::vector<int64_t>> dealt(threads);
  for (const int64_t i : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    dealt[t].push_back(i);
    load[t] += costs[i];
  }
  for (std::vector<int64_t>& items : dealt) std::sort(items.begin(), items.end());
  fastcpu::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (!dealt[t].empty()) fn(dealt[t].data(), static_cast<int64_t>(dealt[t].size()));
  });
}

// ------------------------------------------------------------------ activations in the model's dtype
// The kernels compute in fp32 but take and give the model's activations as they are (float32 or bfloat16):
// converting here costs a loop over a few thousand values, where a conversion through torch from Python cost
// ~5 us of dispatch per tensor, a dozen times per layer of a decode step.

// What the linear kernels take as activations: float32 or bfloat16 [M, K] with contiguous rows.
inline void check_activation_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bfloat16");
}

// x as float32 rows with contiguous elements: x itself, or a widened copy of a bfloat16 x (exact).
inline torch::Tensor float_rows(const torch::Tensor& x) {
  check_activation_rows(x);
  if (x.scalar_type() == torch::kFloat32) return x;
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
  torch::Tensor xf = torch::empty({m, k}, x.options().dtype(torch::kFloat32));
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  float* dst = xf.data_ptr<float>();
  fastcpu::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t i = 0;
      for (; i + 16 <= k; i += 16) store(dst + r * k + i, load(src + r * ldx + i));
      for (; i < k; ++i) dst[r * k + i] = static_cast<float>(src[r * ldx + i]);
    }
  });
  return xf;
}

// Attention queries [T, H, D] with each row's heads side by side (any row stride, so a view of wider rows is read
// in place): q itself when they are, else a contiguous copy.
inline torch::Tensor heads_side_by_side(const torch::Tensor& q) {
  return q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
}

// Scratch a kernel keeps per thread from call to call (a decode step makes hundreds of calls, each of which
// allocated and freed its buffers): v's storage with room for n elements, its contents the caller's to write. One
// grown past kKeptScratchBytes for a large call (a long prefill chunk) is released at the next smaller one.
constexpr int64_t kKeptScratchBytes = 1 << 20;
template <typename T>
T* kept_scratch(std::vector<T>& v, int64_t n) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  if (static_cast<int64_t>(v.capacity() * sizeof(T)) > kKeptScratchBytes && bytes <= kKeptScratchBytes)
    std::vector<T>().swap(v);
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// The linear kernels' optional bias: float32 [n] (null when absent).
inline const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n, "bad bias");
  return bias->data_ptr<float>();
}

// 16 fp32 products (the first `count` of them) into a bfloat16 row as torch's ``r.add_(y.to(bfloat16))`` (add) or
// ``y.to(bfloat16)`` would store them: rounded to bf16, then added in fp32 to what the row holds and rounded again.
inline void store_bf16_products(at::BFloat16* r, v16 y, bool add, int64_t count) {
  y = round_to(y, static_cast<at::BFloat16*>(nullptr));
  if (count == 16) {
    store(r, add ? load(r) + y : y);
    return;
  }
  for (int64_t i = 0; i < count; ++i) r[i] = at::BFloat16(add ? static_cast<float>(r[i]) + y[i] : y[i]);
}

// Where a linear kernel's tile stores its fp32 products (LinearOutput::dest()): fp32 rows y, overwritten or, with
// `accumulate`, added to; or bf16 rows yb, stored into as store_bf16_products does (y is null then).
struct ProductDest {
  float* y;
  int64_t ldy;
  bool accumulate;
  at::BFloat16* yb;
  int64_t ldb;
  bool add;

  // The same destination from row `row`, column `col` on.
  ProductDest at(int64_t row, int64_t col) const {
    return {y ? y + row * ldy + col : nullptr, ldy, accumulate, yb ? yb + row * ldb + col : nullptr, ldb, add};
  }
#ifdef __AVX512F__
  // Row `row`'s 16 products from column `col` (its first `count`, the lanes of `mask`).
  void store(int64_t row, int64_t col, __m512 val, __mmask16 mask, int64_t count) const {
    if (yb != nullptr) {
      store_bf16_products(yb + row * ldb + col, (v16)val, add, count);
      return;
    }
    float* p = y + row * ldy + col;
    if (accumulate) val = _mm512_add_ps(val, _mm512_maskz_loadu_ps(mask, p));
    _mm512_mask_storeu_ps(p, mask, val);
  }
#endif
  // Row `row`'s 8 products from column `col` (its first `count`), stored as store() stores 16.
  void store8(int64_t row, int64_t col, __m256 val, int64_t count) const {
    alignas(32) float v[8];
    _mm256_store_ps(v, val);
    if (yb != nullptr) {
      at::BFloat16* r = yb + row * ldb + col;
      for (int64_t i = 0; i < count; ++i) {
        const float rounded = static_cast<float>(at::BFloat16(v[i]));
        r[i] = at::BFloat16(add ? static_cast<float>(r[i]) + rounded : rounded);
      }
      return;
    }
    float* p = y + row * ldy + col;
    if (count == 8) {  // a whole vector (a loop here became a memcpy call: rep movsl, 5% of an int8 prefill)
      _mm256_storeu_ps(p, accumulate ? _mm256_add_ps(val, _mm256_loadu_ps(p)) : val);
      return;
    }
    for (int64_t i = 0; i < count; ++i) p[i] = accumulate ? p[i] + v[i] : v[i];
  }
};

// Where a linear kernel's fp32 products go and what its caller gets back. Without ``out``: a new [m, n] in x's
// dtype. With ``out`` (a residual): the products are added to it in place — a float32 ``out`` takes them
// directly (the kernel accumulates), a bfloat16 one as torch's ``out.add_(y.to(bfloat16))`` would: y rounded to
// bf16, added in fp32, rounded again, so a bf16 model's residual stream has the same bits either way.
// A kernel either writes fp32 products to data() (a staging buffer when the result is bf16, rounded into it by
// finish()) or stores them through dest() (a bf16 result directly: no staging buffer and no pass over it, ~2-12 us
// per call at decode sizes).
class LinearOutput {
 public:
  LinearOutput(const c10::optional<torch::Tensor>& out, const torch::Tensor& x, int64_t m, int64_t n)
      : m_(m), n_(n), f32_(x.options().dtype(torch::kFloat32)) {
    if (out.has_value()) {
      TORCH_CHECK(out->dim() == 2 && out->size(0) == m && out->size(1) == n && out->stride(1) == 1 &&
                  (out->scalar_type() == torch::kFloat32 || out->scalar_type() == torch::kBFloat16),
                  "out must be float32 or bfloat16 [M, N] with contiguous rows");
      result_ = *out;
      accumulate_ = out->scalar_type() == torch::kFloat32;
      add_into_ = !accumulate_;
    } else {
      result_ = torch::empty({m, n}, x.scalar_type() == torch::kFloat32 ? f32_ : x.options());
    }
    if (result_.scalar_type() == torch::kFloat32) acc_ = result_;
  }
  // Where fp32 products go ([m, n], row stride ld()).
  float* data() {
    if (!acc_.defined()) acc_ = torch::empty({m_, n_}, f32_);
    return acc_.data_ptr<float>();
  }
  int64_t ld() const { return acc_.defined() ? acc_.stride(0) : n_; }
  // Whether the kernel adds its products into data() (else it overwrites them).
  bool accumulate() const { return accumulate_; }
  // For a kernel whose tiles store their products themselves: a bf16 result directly (no staging buffer), an
  // fp32 one as data().
  ProductDest dest() {
    if (result_.scalar_type() == torch::kBFloat16)
      return {nullptr, 0, false, result_.data_ptr<at::BFloat16>(), result_.stride(0), add_into_};
    return {data(), ld(), accumulate_, nullptr, 0, false};
  }

  // The result, once the kernel has written data() or dest().
  torch::Tensor finish() {
    if (result_.scalar_type() == torch::kFloat32 || !acc_.defined()) return result_;
    const int64_t ldr = result_.stride(0);
    const float* a = acc_.data_ptr<float>();
    at::BFloat16* r = result_.data_ptr<at::BFloat16>();
    const bool add = add_into_;
    const int64_t n = n_;
    fastcpu::parallel_for(0, m_, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row)
        for (int64_t i = 0; i < n; i += 16)
          store_bf16_products(r + row * ldr + i, load16(a + row * n + i, std::min<int64_t>(16, n - i)), add,
                              std::min<int64_t>(16, n - i));
    });
    return result_;
  }

 private:
  // count (1..16) floats as a v16 (the rest zero): a row's tail without reading past it.
  static v16 load16(const float* p, int64_t count) {
    if (count == 16) return load(p);
    v16 v = splat(0.f);
    for (int64_t i = 0; i < count; ++i) v[i] = p[i];
    return v;
  }

  int64_t m_, n_;
  torch::TensorOptions f32_;
  torch::Tensor acc_, result_;
  bool accumulate_ = false, add_into_ = false;
};

}  // namespace fastcpu
