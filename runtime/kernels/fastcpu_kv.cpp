// store_kv: new tokens' K and V rows written into their slots of one layer's KV pools, as they are or quantised
// into the int8 KV format (radix/kv_int8.py, whose torch writer stores the same bytes). The paged backend's in-place
// path (runtime/attention/paged_decode.py) and the decode stack (fastcpu_decoder.cpp) write through it.

#include "fastcpu_ops.h"
#include "fastcpu_team.h"
#include "fastcpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

namespace {

// One (token, KV head) row of n floats (or bf16) in the int8 KV format (radix/kv_int8.py, whose rounding this
// repeats operation for operation, so that both writers store the same bytes): the values, then the float32 scale.
// The scalar loop took ~4 us of a batch-8 decode step's layer (48 rows of 64: a rounding call per value). The vector
// form, 8 values a register on every CPU with AVX2 (AVX-512 hosts included, so every host's tests run it), stores
// the same bytes: max is exact in any order, the products are the same fp32 operations, and rounding to nearest even
// is nearbyint in the default rounding mode. A NaN product becomes -127 in both (max / min return their second
// operand when the first is NaN, as std::max(-127, NaN) returns -127).
template <typename T>
void quantize_row(const T* x, int64_t n, int8_t* out) {
#ifdef __AVX2__
  if (n % 8 == 0) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) vmax = _mm256_max_ps(_mm256_andnot_ps(sign, fastcpu::load8(x + i)), vmax);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = lanes[0];
    for (int l = 1; l < 8; ++l) amax = std::max(amax, lanes[l]);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(fastcpu::load8(x + i), inv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(words, words));
    }
    const float scale = amax / 127.f;
    std::memcpy(out + n, &scale, sizeof(scale));
    return;
  }
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(x[i]) * inv))));
  const float scale = amax / 127.f;
  std::memcpy(out + n, &scale, sizeof(scale));
}

template <typename T>
void quantize_rows(const torch::Tensor& x, int8_t* pool, const int64_t* sp, int64_t heads, int64_t d) {
  const T* src = x.data_ptr<T>();
  const int64_t ld = x.stride(0), row = d + 4;
  fastcpu::parallel_for(0, x.size(0), 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t h = 0; h < heads; ++h) quantize_row(src + i * ld + h * d, d, pool + (sp[i] * heads + h) * row);
  });
}

}  // namespace

// The K and V rows of new tokens ([T, Hkv, D] each, any row stride, contiguous heads) into pool rows ``slots``
// of the 2-D pools of one layer: [slots, Hkv * D] in the tokens' dtype, stored as they are — one call for what
// two index_copy_ calls through torch did (a few microseconds of dispatch each, per layer of every step) — or
// [slots, Hkv * (D + 4)] int8, each (token, head) row quantised into the int8 KV format.
void store_kv(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k_pool.dim() == 2 && v_pool.dim() == 2 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
              k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type(),
              "pools must be contiguous [slots, Hkv * D] of one shape and dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "slots must be contiguous int64 [T]");
  const bool int8 = k_pool.scalar_type() == torch::kInt8;
  const int64_t t = slots.size(0), width = k_pool.size(1), rows = k_pool.size(0);
  for (const torch::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == t && x->size(1) * (x->size(2) + (int8 ? 4 : 0)) == width &&
                x->stride(2) == 1 && x->stride(1) == x->size(2) && x->scalar_type() == k.scalar_type() &&
                (int8 ? x->scalar_type() == torch::kFloat32 || x->scalar_type() == torch::kBFloat16
                      : x->scalar_type() == k_pool.scalar_type()),
                "k and v must be [T, Hkv, D] in the pool's dtype (float32 or bfloat16 for an int8 pool)");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < rows, "slot out of range");
  if (int8) {
    const int64_t heads = k.size(1), d = k.size(2);
    for (const auto& [x, pool] : {std::pair{&k, &k_pool}, std::pair{&v, &v_pool}}) {
      if (x->scalar_type() == torch::kFloat32)
        quantize_rows<float>(*x, pool->data_ptr<int8_t>(), sp, heads, d);
      else
        quantize_rows<at::BFloat16>(*x, pool->data_ptr<int8_t>(), sp, heads, d);
    }
    return;
  }
  const int64_t bytes = width * k_pool.element_size();
  char* kp = static_cast<char*>(k_pool.data_ptr());
  char* vp = static_cast<char*>(v_pool.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  const int64_t kld = k.stride(0) * k.element_size(), vld = v.stride(0) * v.element_size();
  fastcpu::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      std::memcpy(kp + sp[i] * bytes, ks + i * kld, bytes);
      std::memcpy(vp + sp[i] * bytes, vs + i * vld, bytes);
    }
  });
}
