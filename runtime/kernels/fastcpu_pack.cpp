// Packing one layer's KV prefix for extend_attention's dot products (the layout: fastcpu_pack.h): per call inside
// extend_attention, or once by pack_prefix for a prefix that many calls read (a cascade group's, over decode steps).
// A bf16 pool's rows are packed as they are, an int8 pool's (radix/kv_int8.py) converted to bf16 as they are packed.
// Built only where FASTCPU_BF16_DOT is set (fastcpu_vec.h), as extend_attention is.

#include "fastcpu_attend.h"
#include "fastcpu_ops.h"
#include "fastcpu_pack.h"
#include "fastcpu_team.h"
#include "fastcpu_vec.h"

#ifdef FASTCPU_BF16_DOT

namespace fastcpu::extend {

namespace {

// Words col0 .. col0 + 15 of 16 rows, transposed: out + 16 * i receives word col0 + i of rows 0 .. 15. Three
// rounds of in-lane unpacks and 128-bit lane shuffles (64 instructions for 256 words) instead of a strided scalar
// store per word, which made packing the prefix most of the kernel's time at a few query rows.
inline void transpose_words16(const uint32_t* const* rows, int64_t col0, uint32_t* out) {
  __m512i a[16], u[16];
  for (int r = 0; r < 16; ++r) a[r] = _mm512_loadu_si512(rows[r] + col0);
  // u[4g + c], 128-bit lane L: word 4L + c of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    const __m512i t0 = _mm512_unpacklo_epi32(a[4 * g], a[4 * g + 1]), t1 = _mm512_unpackhi_epi32(a[4 * g], a[4 * g + 1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[4 * g + 2], a[4 * g + 3]);
    const __m512i t3 = _mm512_unpackhi_epi32(a[4 * g + 2], a[4 * g + 3]);
    u[4 * g] = _mm512_unpacklo_epi64(t0, t2);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t0, t2);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t1, t3);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t1, t3);
  }
  // word 4L + c of all 16 rows: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
  for (int c = 0; c < 4; ++c) {
    const __m512i p = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), q = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i r = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i s = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    _mm512_storeu_si512(out + 16 * c, _mm512_shuffle_i32x4(p, r, 0x88));
    _mm512_storeu_si512(out + 16 * (4 + c), _mm512_shuffle_i32x4(p, r, 0xDD));
    _mm512_storeu_si512(out + 16 * (8 + c), _mm512_shuffle_i32x4(q, s, 0x88));
    _mm512_storeu_si512(out + 16 * (12 + c), _mm512_shuffle_i32x4(q, s, 0xDD));
  }
}

// An int8 row's values as bf16: value x scale in fp32, rounded to nearest even, as radix/kv_int8.py's dequantize
// computes them and torch rounds them to bfloat16 (the same bits as packing its dequantised rows, which the
// callers did before: per layer, an index_select and four torch ops over the whole prefix, 18% of the forward's
// samples in a profile of single questions over a cached block).
inline void int8_row_bf16(const int8_t* row, int64_t d, uint16_t* out) {
  const __m512 sv = _mm512_set1_ps(fastcpu::attend::row_scale(row, d));
  const auto part = [&](int64_t c) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), sv);
  };
  for (int64_t c = 0; c < d; c += 32)
    _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(part(c + 16), part(c)));
}

// Tile `tile` of KV head kvh, in the layout of fastcpu_pack.h.
void pack_tile(const PoolRows& pool, int64_t kvh, const int64_t* slots, int64_t s, int64_t d, int64_t tile,
               uint16_t* kp, uint16_t* vp) {
  static const uint16_t zeros[kMaxDim] = {};
  alignas(64) uint16_t kbuf[kKeys][kMaxDim], vbuf[kKeys][kMaxDim];  // an int8 pool's rows in bf16
  const int64_t pairs = d / 2;
  const uint16_t* krow[kKeys];
  const uint16_t* vrow[kKeys];
  for (int64_t key = 0; key < kKeys; ++key) {
    const int64_t j = tile * kKeys + key;
    if (j >= s) {
      krow[key] = vrow[key] = zeros;
      continue;
    }
    const int64_t off = slots[j] * pool.slot_bytes + kvh * pool.head_bytes;
    if (pool.int8) {
      int8_row_bf16(reinterpret_cast<const int8_t*>(pool.k + off), d, kbuf[key]);
      int8_row_bf16(reinterpret_cast<const int8_t*>(pool.v + off), d, vbuf[key]);
      krow[key] = kbuf[key];
      vrow[key] = vbuf[key];
    } else {
      krow[key] = reinterpret_cast<const uint16_t*>(pool.k + off);
      vrow[key] = reinterpret_cast<const uint16_t*>(pool.v + off);
    }
  }
  // K: a dim pair is one 32-bit word of a key's row, so the tile is a 16 x D/2 transpose of words.
  uint32_t* kt = reinterpret_cast<uint32_t*>(kp + tile * kKeys * d);
  const uint32_t* kwords[kKeys];
  for (int64_t key = 0; key < kKeys; ++key) kwords[key] = reinterpret_cast<const uint32_t*>(krow[key]);
  for (int64_t c0 = 0; c0 < pairs; c0 += 16) transpose_words16(kwords, c0, kt + c0 * kKeys);
  // V: word c of a key pair is (value c of the even key) | (value c of the odd key) << 16.
  uint32_t* vt = reinterpret_cast<uint32_t*>(vp + tile * kKeys * d);
  for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
    const uint16_t* even = vrow[2 * jp];
    const uint16_t* odd = vrow[2 * jp + 1];
    for (int64_t c = 0; c < d; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + c)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + c)));
      _mm512_storeu_si512(vt + jp * d + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

}  // namespace

void pack_heads(const PoolRows& pool, int64_t hkv, int64_t d, const int64_t* slots, int64_t s, int64_t padded,
                uint16_t* kp, uint16_t* vp) {
  const int64_t tiles = padded / kKeys;
  fastcpu::parallel_for(0, hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / tiles;
      pack_tile(pool, kvh, slots, s, d, item % tiles, kp + kvh * padded * d, vp + kvh * padded * d);
    }
  });
}

PoolRows check_pools(const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& kv_index,
                     int64_t hkv, int64_t d) {
  TORCH_CHECK(d == 64 || d == 128, "head dim must be 64 or 128");
  const bool int8 = k_pool.scalar_type() == torch::kChar;
  const int64_t row = int8 ? d + 4 : d;  // a head's row: its values (and an int8 row's scale)
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  (k_pool.scalar_type() == torch::kBFloat16 || int8) && v_pool.scalar_type() == k_pool.scalar_type() &&
                  k_pool.numel() % (hkv * row) == 0 && v_pool.numel() == k_pool.numel(),
              "KV pools must be contiguous [slots, kv_heads * head_dim] bfloat16, or int8 with head_dim + 4 bytes "
              "per head (the int8 format)");
  TORCH_CHECK(kv_index.dim() == 1 && kv_index.scalar_type() == torch::kInt64, "kv_index must be int64 [S]");
  const int64_t rows = k_pool.numel() / (hkv * row);
  const int64_t* slots = kv_index.data_ptr<int64_t>();
  for (int64_t j = 0; j < kv_index.size(0); ++j)
    TORCH_CHECK(slots[j * kv_index.stride(0)] >= 0 && slots[j * kv_index.stride(0)] < rows, "slot out of range");
  const int64_t elem = int8 ? 1 : 2;
  return {static_cast<const char*>(k_pool.data_ptr()), static_cast<const char*>(v_pool.data_ptr()),
          hkv * row * elem, row * elem, int8};
}

}  // namespace fastcpu::extend

#endif  // FASTCPU_BF16_DOT

// The prefix kv_index [S] of one layer packed as extend_attention reads it: (K, V), each bfloat16 [Hkv, S', D]
// (S' = S rounded up to 32, zeros past S). Handed back to extend_attention for the same slots, it skips the
// packing — for a prefix whose KV does not change between calls (a cascade group's, over decode steps).
std::vector<torch::Tensor> pack_prefix(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor kv_index,
                                       int64_t num_kv_heads, int64_t head_dim) {
#ifdef FASTCPU_BF16_DOT
  using namespace fastcpu::extend;
  const int64_t hkv = num_kv_heads, d = head_dim;
  const PoolRows pools = check_pools(k_pool, v_pool, kv_index, hkv, d);
  kv_index = kv_index.contiguous();
  const int64_t s = kv_index.size(0), padded = padded_keys(s);
  auto opts = k_pool.options().dtype(torch::kBFloat16);
  torch::Tensor kp = torch::empty({hkv, padded, d}, opts), vp = torch::empty({hkv, padded, d}, opts);
  pack_heads(pools, hkv, d, kv_index.data_ptr<int64_t>(), s, padded,
             reinterpret_cast<uint16_t*>(kp.data_ptr<at::BFloat16>()),
             reinterpret_cast<uint16_t*>(vp.data_ptr<at::BFloat16>()));
  return {kp, vp};
#else
  TORCH_CHECK(false, "pack_prefix needs AVX512_BF16 (this build targets a CPU without it)");
  return {k_pool};
#endif
}
