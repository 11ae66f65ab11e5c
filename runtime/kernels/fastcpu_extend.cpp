// extend_attention: many new tokens of one request (a prefill chunk over a cached prefix), or the query rows
// of a cascade group against its shared prefix, attending one row of slots of a KV pool, with AVX512_BF16 dot
// products. A bf16 pool's rows are packed as they are, an int8 pool's (radix/kv_int8.py) converted to bf16 as they
// are packed.
//
// Why: decode_attention (fastcpu_attention.cpp) scores a handful of query heads per pass over the KV with
// fp32 FMAs, which is right for decode rows and drafts but makes a 100-token chunk over a 1k-token prefix pass
// over the prefix ~34 times; torch's SDPA gathers and runs a general flash kernel. Here the prefix is packed
// once per KV head into the layout vdpbf16ps takes, and the scores and the weighted sum of values are two small
// GEMMs per block of query rows (all query heads of all tokens that share a KV head are rows).
//
// Numerics: queries are rounded to bf16 (they are bf16 tensors already where the model runs in bf16); scores are
// fp32 sums of bf16 products, times the scale, in fp32; the softmax is fp32 (its sum too); the probabilities are
// rounded to bf16 for the weighted sum of values, which accumulates in fp32 — as torch's CPU flash attention does for
// bf16 inputs. Token t sees slots kv_index[0 .. lengths[t] - 1].
//
// Built only where FASTCPU_BF16_DOT is set (fastcpu_vec.h); bf16_dot() tells (the callers check it).
//
// On CPUs with AMX (fastcpu_amx.h) both GEMMs run on the tiles, over the same packs: 16 dim pairs of a key tile
// are a B tile of the scores (rows of 64 bytes, contiguous), 16 key pairs x 16 dims of the values one of the
// value sum; the queries (row-major) and the probabilities are the A tiles. The softmax between them is the same.

#include "fastcpu_amx.h"
#include "fastcpu_attend.h"
#include "fastcpu_fetch.h"
#include "fastcpu_vec.h"

#include <memory>
#include <optional>
#include <tuple>
#include <utility>

namespace {

#ifdef FASTCPU_BF16_DOT

using namespace fastcpu;

constexpr int64_t kKeys = 16;  // keys per score tile: one vector of fp32 scores
// Query rows per block of the score pass: 8 (x 3 key tiles = 24 accumulators), or 12 (x 2 tiles) where that splits
// the blocks more evenly between the threads (see block_rows). A row's result does not depend on its block.
constexpr int kRows = 8;
constexpr int kWideRows = 12;
constexpr int kTileRows = 16;  // on the tiles (AMX) only: a whole A tile of query rows
constexpr int kPvRows = 4;  // query rows per pass of the value sum (4 rows x D/16 accumulators)
constexpr int64_t kMaxDim = 128;

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

// One layer's K and V pools as the packing reads them: rows of bf16 values, or of the int8 format (head_dim int8
// values, then the row's float32 scale: radix/kv_int8.py), converted to bf16 as they are packed.
struct PoolRows {
  const char* k;
  const char* v;
  int64_t slot_bytes;  // a slot's row over all KV heads
  int64_t head_bytes;  // one head's part of it
  bool int8;
};

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

// K of one KV head as tiles of 16 keys: [tiles][D/2][16 keys][2] — for each pair of dims, the 16 keys' two
// values side by side (vdpbf16ps's operand). V as pairs of keys: [S/2][D][2] — for each pair of keys, every
// dim's two values side by side. Both take 16 * D values per tile. Keys past S are zero. Packs tile `tile`.
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

// Every tile of every KV head of the slots [S]: kp and vp each [Hkv][padded][D] (padded: S rounded up to 32).
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

// The checks both entry points make on the pools and the slot row; the pools as pack_heads reads them.
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

// Scores of R query rows (bf16 pairs, interleaved: word i of row r at qp[i * R + r]) against NT key tiles from
// `tile`: sc[r][j], unscaled (softmax_row applies the scale as it reads them). Each broadcast query word feeds NT
// dot products (one per tile), so NT = 3 takes a third of the broadcasts per product that one tile at a time did
// (R x NT = 24 accumulators, NT key vectors and a broadcast in the 32 registers). The interleaved words are one
// pointer for all R rows: with a pointer per row the loop needed more general registers than there are, and the
// compiler kept some in vector registers and a key vector on the stack, reloaded before every other product.
template <int R, int NT>
inline void score_tiles(const uint32_t* qp, int64_t pairs, const uint16_t* kp, int64_t tile, float* sc, int64_t ldsc,
                        bool kept, FetchCursor& fetch) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const uint16_t* kt = kp + tile * pairs * kKeys * 2;
  // A kept pack (pack_prefix's, over decode steps) comes from memory: ask for the next NT tiles (the next call's),
  // NT lines per pair of dims. One packed in this call is in cache already, and asking cost 2-4%.
  const char* next = reinterpret_cast<const char*>(kt + NT * pairs * kKeys * 2);
  for (int64_t i = 0; i < pairs; ++i) {
    if (kept)
      for (int t = 0; t < NT; ++t) _mm_prefetch(next + (i * NT + t) * 64, _MM_HINT_T0);
    fetch.tick();
    __m512bh kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = (__m512bh)_mm512_loadu_si512(kt + (t * pairs + i) * kKeys * 2);
    const uint32_t* words = qp + i * R;
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(words[r]));
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], kv[t], qb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t)
      _mm512_storeu_ps(sc + r * ldsc + (tile + t) * kKeys, acc[r][t]);
}

// Scores of R query rows against key tiles [0, tiles). A score's sum over the dims runs in the same order
// whichever pass computes it, so the bits do not depend on R or NT.
template <int R>
void score_rows(const uint32_t* qp, int64_t pairs, const uint16_t* kp, int64_t tiles, float* sc, int64_t ldsc,
                bool kept, FetchCursor& fetch) {
  constexpr int NT = 24 / R;
  int64_t tile = 0;
  for (; tile + NT <= tiles; tile += NT) score_tiles<R, NT>(qp, pairs, kp, tile, sc, ldsc, kept, fetch);
  for (; tile < tiles; ++tile) score_tiles<R, 1>(qp, pairs, kp, tile, sc, ldsc, kept, fetch);
}

// Rows per block for `rows` rows per KV head over `hkv` heads on `threads` threads: 12 where that leaves the busiest
// thread fewer rows than blocks of 8 do (a batch-8 decode group under a shared prefix: 24 rows x 3 KV heads made 9
// blocks of 8, 5 and 4 on two threads; 6 blocks of 12 split 3 and 3), else 8. On the tiles, 16 where that leaves
// the busiest thread no more rows than those (a prefill chunk's many rows): a block's passes over the keys cost about
// as much at 16 rows as at 12, as the tile instructions' time grows little with their rows, so 16-row blocks take
// three quarters of the passes. Only the work split changes.
int64_t block_rows(int64_t rows, int64_t hkv, int64_t threads, bool tiles) {
  const auto busiest = [&](int64_t r) {
    const int64_t blocks = (rows + r - 1) / r;
    return (hkv * blocks + threads - 1) / threads * std::min(r, rows);
  };
  const int64_t narrow = busiest(kWideRows) < busiest(kRows) ? kWideRows : kRows;
  return tiles && rows >= kTileRows && busiest(kTileRows) <= busiest(narrow) ? kTileRows : narrow;
}

// 2^t for the softmax's t = (score - max) x log2(e) <= 0: 2^n (vscalefps) times a degree-5 polynomial of the
// fraction f = t - n, |f| <= 1/2 (fitted for the least relative error over that interval: below 1e-7, the order of
// exp16's, so the bf16 rounding of a probability changes as rarely). Where exp16 reduces x by n ln 2 in two steps and
// takes a degree-6 polynomial, the base-2 argument needs no reduction and one term less: eleven operations instead
// of sixteen, in the pass that was the kernel's largest. t is clamped at -125, where 2^t is still a normal float
// (a subnormal result costs a microcode assist); such a probability is far below the bf16 resolution of the row's
// largest, which is 1.
inline v16 exp2_softmax(v16 t) {
  const __m512 tc = _mm512_max_ps((__m512)t, _mm512_set1_ps(-125.0f));
  const __m512 n = _mm512_roundscale_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(tc, n);
  __m512 y = _mm512_set1_ps(1.327647129e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.675540961e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550713092e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402212024e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931469440e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.000000119f));
  return (v16)_mm512_scalef_ps(y, n);
}

// Row r's softmax over its first len keys of raw scores s (times `scale`, > 0): writes its probabilities as bf16
// pairs (zero from len on, up to `padded` keys, a multiple of 32) and returns (max, sum), both of the scaled scores.
// The probabilities go from the exponential straight to their bf16 pairs, 32 keys at a time: writing them back as
// fp32 and converting in another pass (with a pass to zero the padding) took a third of the kernel's time at decode
// rows. The scale is applied here, not in a pass of its own over the scores (at a prefill chunk's rows that pass
// re-read and re-wrote a block's ~50 KB of scores from L2 and took ~8% of the kernel): a probability is
// 2^(s c - m), c = scale x log2(e) and m = max(s) x c, the product and the difference rounded once (one fmsub).
//
// Both passes keep several vectors in flight. One exponential is a chain of ~10 dependent operations; the loops that
// took one 16-key vector at a time, and the max through one register, ran at the chains' latency rather than the
// ports' rate (in a loop over one row in L1: 13 cycles a vector for the old exponential one at a time, 11 four at a
// time, 8.7 for exp2_softmax four at a time). The max takes four registers (max is exact: any order gives the same
// result), the exponentials 64 keys at a time.
std::pair<float, float> softmax_row(const float* s, int64_t len, int64_t padded, float scale, uint32_t* pp) {
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  int64_t j = 0;
  for (; j + 64 <= len; j += 64) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + j + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + j + 48));
  }
  for (; j + 16 <= len; j += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
  if (j < len) m1 = _mm512_mask_max_ps(m1, static_cast<__mmask16>((1u << (len - j)) - 1u), m1,
                                       _mm512_loadu_ps(s + j));
  const float smax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  const float c = scale * 1.44269504088896341f;
  const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(smax * c);
  // the probabilities of the 16 keys from j0, all below len
  const auto live_exp = [&](int64_t j0) { return exp2_softmax((v16)_mm512_fmsub_ps(_mm512_loadu_ps(s + j0), cv, mv)); };
  // the same up to len, zero past it
  const auto tail_exp = [&](int64_t j0) {
    if (j0 >= len) return splat(0.f);
    const __mmask16 live = j0 + 16 <= len ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << (len - j0)) - 1u);
    return (v16)_mm512_maskz_mov_ps(live, (__m512)live_exp(j0));
  };
  v16 sum = splat(0.f);
  int64_t k = 0;
  for (; k + 64 <= len; k += 64) {
    const v16 p0 = live_exp(k), p1 = live_exp(k + 16), p2 = live_exp(k + 32), p3 = live_exp(k + 48);
    sum += p0;
    sum += p1;
    sum += p2;
    sum += p3;
    _mm512_storeu_si512(pp + k / 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0));
    _mm512_storeu_si512(pp + k / 2 + 16, (__m512i)_mm512_cvtne2ps_pbh((__m512)p3, (__m512)p2));
  }
  for (; k < padded; k += 32) {
    const v16 lo = tail_exp(k), hi = tail_exp(k + 16);
    sum += lo;
    sum += hi;
    _mm512_storeu_si512(pp + k / 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
  }
  return {smax * scale, _mm512_reduce_add_ps((__m512)sum)};
}

// out[r][:] = sum over key pairs of probabilities x values, for RB rows (NV = D / 16 accumulators each).
template <int RB, int NV>
void value_rows(const uint32_t* pp, int64_t ldp, int64_t key_pairs, const uint16_t* vp, float* out, int64_t ldo,
                FetchCursor& fetch) {
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < key_pairs; ++jp) {
    fetch.tick();
    __m512bh v[NV];
    for (int c = 0; c < NV; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + jp * NV * 32 + c * 32);
    for (int r = 0; r < RB; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * ldp + jp]));
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], p);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + r * ldo + c * 16, acc[r][c]);
}

template <int NV>
void value_block(const uint32_t* pp, int64_t ldp, int64_t key_pairs, const uint16_t* vp, float* out, int64_t ldo,
                 int64_t rows, FetchCursor& fetch) {
  constexpr int RB = NV <= 4 ? kPvRows : 2;
  int64_t r = 0;
  for (; r + RB <= rows; r += RB) value_rows<RB, NV>(pp + r * ldp, ldp, key_pairs, vp, out + r * ldo, ldo, fetch);
  for (; r < rows; ++r) value_rows<1, NV>(pp + r * ldp, ldp, key_pairs, vp, out + r * ldo, ldo, fetch);
}

#ifdef FASTCPU_AMX

// Tiles 0-3: fp32 results of a block's rows (4 key tiles' scores, or 4 slices of 16 dims of the value sum); 4: the
// rows' queries (16 dim pairs) or probabilities (16 key pairs); 6, 7: key or value tiles, loaded in turn.
fastcpu::TileConfig attention_tiles(int rows) {
  fastcpu::TileConfig c;
  for (int t = 0; t < 5; ++t) c.tile(t, rows, 64);
  return c.tile(6, 16, 64).tile(7, 16, 64);
}

// Scores of the block's rows (queries row-major: qrow [rows][pairs], pairs a multiple of 16) against key tiles
// [0, tiles), unscaled, into sc. A kept pack comes from memory: the next 4 key tiles are asked for while these run.
void score_rows_amx(const uint32_t* qrow, int64_t pairs, const uint16_t* kp, int64_t tiles, float* sc, int64_t ldsc,
                    bool kept, FetchCursor& fetch) {
  const int64_t tile_elems = pairs * kKeys * 2;  // one key tile of the pack
  for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
    const int64_t nt = std::min<int64_t>(4, tiles - t0);
    const uint16_t* kt = kp + t0 * tile_elems;
    if (kept) {
      const char* next = reinterpret_cast<const char*>(kt + 4 * tile_elems);
      for (int64_t line = 0; line < 4 * tile_elems * 2 / 64; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    }
    fastcpu::zero_x4();
    for (int64_t i0 = 0; i0 < pairs; i0 += 16) {
      for (int tick = 0; tick < 16; ++tick) fetch.tick();
      const uint16_t* k = kt + i0 * kKeys * 2;
      _tile_loadd(4, qrow + i0, pairs * 4);
      _tile_loadd(6, k, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (nt > 1) {
        _tile_loadd(7, k + tile_elems, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (nt > 2) {
        _tile_loadd(6, k + 2 * tile_elems, 64);
        _tile_dpbf16ps(2, 4, 6);
      }
      if (nt > 3) {
        _tile_loadd(7, k + 3 * tile_elems, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    float* out = sc + t0 * kKeys;
    _tile_stored(0, out, ldsc * 4);
    if (nt > 1) _tile_stored(1, out + 16, ldsc * 4);
    if (nt > 2) _tile_stored(2, out + 32, ldsc * 4);
    if (nt > 3) _tile_stored(3, out + 48, ldsc * 4);
  }
}

// out[r][:] = sum over key pairs [0, key_pairs) (a multiple of 16) of probabilities x values, on the tiles.
void value_rows_amx(const uint32_t* pp, int64_t ldp, int64_t key_pairs, const uint16_t* vp, int64_t d, float* out,
                    int64_t ldo, FetchCursor& fetch) {
  const int64_t ldv = d * 4;  // bytes from one key pair's values to the next's
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    fastcpu::zero_x4();
    for (int64_t jp0 = 0; jp0 < key_pairs; jp0 += 16) {
      for (int tick = 0; tick < 16; ++tick) fetch.tick();
      fastcpu::bf16_products_x4(pp + jp0, ldp * 4, vp + (jp0 * d + c0) * 2, ldv);
    }
    fastcpu::store_x4(out + c0, ldo);
  }
}

#endif  // FASTCPU_AMX

#endif  // FASTCPU_BF16_DOT

}  // namespace

// The prefix kv_index [S] of one layer packed as extend_attention reads it: (K, V), each bfloat16 [Hkv, S', D]
// (S' = S rounded up to 32, zeros past S). Handed back to extend_attention for the same slots, it skips the
// packing — for a prefix whose KV does not change between calls (a cascade group's, over decode steps).
std::vector<torch::Tensor> pack_prefix(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor kv_index,
                                       int64_t num_kv_heads, int64_t head_dim) {
#ifdef FASTCPU_BF16_DOT
  const int64_t hkv = num_kv_heads, d = head_dim;
  const PoolRows pools = check_pools(k_pool, v_pool, kv_index, hkv, d);
  kv_index = kv_index.contiguous();
  const int64_t s = kv_index.size(0), padded = (s + 31) / 32 * 32;
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

// q [T, H, D] (float32 or bfloat16); pools bfloat16 [slots, Hkv * D]; kv_index int64 [S]; lengths int64 [T] (1..S);
// packed: pack_prefix's result for these slots (the pools are then not read), or none (packed here); fetch:
// weights the threads ask for between their dot products (fastcpu_fetch.h), or none. Returns
// (out [T, H, D] float32, lse [T, H] float32).
std::vector<torch::Tensor> extend_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                            torch::Tensor kv_index, torch::Tensor lengths, double scale,
                                            int64_t num_kv_heads, c10::optional<std::vector<torch::Tensor>> packed,
                                            const fastcpu::FetchPlan* fetch) {
#ifdef FASTCPU_BF16_DOT
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16),
              "q must be float32 or bfloat16 [T, H, D]");
  q = fastcpu::float_queries(q);
  const int64_t t_count = q.size(0), h = q.size(1), d = q.size(2), hkv = num_kv_heads;
  TORCH_CHECK(h % hkv == 0, "query heads must be a multiple of the KV heads");
  std::optional<PoolRows> pools;
  if (packed.has_value()) {  // the pack holds the prefix's K and V, so the pools are not read
    TORCH_CHECK((d == 64 || d == 128) && kv_index.dim() == 1 && kv_index.scalar_type() == torch::kInt64,
                "head dim must be 64 or 128 and kv_index int64 [S]");
  } else {
    pools = check_pools(k_pool, v_pool, kv_index, hkv, d);
  }
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.numel() == t_count, "lengths must be int64 [T]");
  kv_index = kv_index.contiguous();
  lengths = lengths.contiguous();
  const int64_t s = kv_index.size(0), group = h / hkv, pairs = d / 2;
  const int64_t* lens = lengths.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_count; ++t) TORCH_CHECK(lens[t] >= 1 && lens[t] <= s, "lengths must be in 1..S");
  // keys padded to a multiple of 32: the probabilities become bf16 pairs 32 keys at a time
  const int64_t padded = (s + 31) / 32 * 32;
  const int64_t rows = t_count * group;
#ifdef FASTCPU_AMX
  const bool on_tiles = fastcpu::amx_permitted();
#else
  const bool on_tiles = false;
#endif
  const int64_t brows = block_rows(rows, hkv, fastcpu::num_threads(), on_tiles);
  const int64_t blocks = (rows + brows - 1) / brows;
  auto opts = q.options().dtype(torch::kFloat32);
  torch::Tensor out = torch::empty({t_count, h, d}, opts);
  torch::Tensor lse = torch::empty({t_count, h}, opts);
  if (t_count == 0) return {out, lse};
  std::unique_ptr<uint16_t[]> kown, vown;
  const uint16_t* kpack;
  const uint16_t* vpack;
  if (packed.has_value()) {
    TORCH_CHECK(packed->size() == 2, "packed must be pack_prefix's (K, V)");
    for (const torch::Tensor& p : *packed)
      TORCH_CHECK(p.is_contiguous() && p.scalar_type() == torch::kBFloat16 && p.dim() == 3 && p.size(0) == hkv &&
                  p.size(1) == padded && p.size(2) == d, "packed K / V must be pack_prefix's for these slots");
    kpack = reinterpret_cast<const uint16_t*>((*packed)[0].data_ptr<at::BFloat16>());
    vpack = reinterpret_cast<const uint16_t*>((*packed)[1].data_ptr<at::BFloat16>());
  } else {  // every element is written by pack_tile: no zero fill (new[] leaves them uninitialised)
    kown.reset(new uint16_t[hkv * padded * d]);
    vown.reset(new uint16_t[hkv * padded * d]);
    pack_heads(*pools, hkv, d, kv_index.data_ptr<int64_t>(), s, padded, kown.get(), vown.get());
    kpack = kown.get();
    vpack = vown.get();
  }
  const float* qf = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  // a block's cost: its rows times the most keys one of its tokens sees (the three passes run that far)
  const auto block_cost = [&](int64_t item) {
    const int64_t r0 = (item % blocks) * brows, nrows = std::min<int64_t>(brows, rows - r0);
    int64_t keys = 0;
    for (int64_t r = r0; r < r0 + nrows; ++r) keys = std::max(keys, lens[r / group]);
    return nrows * keys;
  };
#ifdef FASTCPU_AMX
  const fastcpu::TileConfig tile_config = attention_tiles(static_cast<int>(brows));
#endif
  parallel_by_cost(hkv * blocks, block_cost, [&](int64_t begin, int64_t end) {
    FetchCursor ahead(fetch, at::get_thread_num(), fastcpu::num_threads());
#ifdef FASTCPU_AMX
    std::optional<fastcpu::TileScope> tiles;
    if (on_tiles) tiles.emplace(tile_config);
#endif
    // Scratch left uninitialised (new[], not std::vector's zero fill: 80 KB a thread per call at a decode group's
    // 12-row blocks): each pass writes what the next one reads, the queries' padding rows are zeroed below.
    std::unique_ptr<uint32_t[]> qp_buf(new uint32_t[brows * pairs]), pp_buf(new uint32_t[brows * padded / 2]);
    std::unique_ptr<float[]> sc_buf(new float[brows * padded]), acc_buf(new float[brows * d]);
    uint32_t* const qp = qp_buf.get();
    uint32_t* const pp = pp_buf.get();
    float* const sc = sc_buf.get();
    float* const acc = acc_buf.get();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / blocks, r0 = (item % blocks) * brows, nrows = std::min<int64_t>(brows, rows - r0);
      const uint16_t* kp = kpack + kvh * padded * d;
      const uint16_t* vp = vpack + kvh * padded * d;
      int64_t max_len = 0;
      std::fill(qp, qp + brows * pairs, 0u);
      for (int64_t r = 0; r < nrows; ++r) {  // row r0 + r: token (r0 + r) / group, query head kvh * group + g
        const int64_t t = (r0 + r) / group, head = kvh * group + (r0 + r) % group;
        const float* qr = qf + (t * h + head) * d;
        uint32_t words[kMaxDim / 2];
        for (int64_t i = 0; i < d; i += 32) bf16_pairs32(qr + i, words + i / 2);
        for (int64_t i = 0; i < pairs; ++i) {
          if (on_tiles)
            qp[r * pairs + i] = words[i];  // row-major (the A tile)
          else
            qp[i * brows + r] = words[i];  // interleaved (score_tiles)
        }
        max_len = std::max(max_len, lens[t]);
      }
      const int64_t used_tiles = (max_len + kKeys - 1) / kKeys, used = used_tiles * kKeys;
      // A kept pack comes from memory for the first block a thread runs of a head, which asks for it ahead of its
      // dot products; the head's later blocks on this thread find it in L2 (~270 KB a head at a 1k-token prefix),
      // where asking again for every line cost ~7% of a prefill chunk's call.
      const bool fetch_pack = packed.has_value() && (item == begin || item % blocks == 0);
      const int64_t used_even = (used + 31) / 32 * 32;  // the pair conversion runs 32 keys at a time
#ifdef FASTCPU_AMX
      if (on_tiles)
        score_rows_amx(qp, pairs, kp, used_tiles, sc, padded, fetch_pack, ahead);
      else
#endif
      if (brows == kWideRows)
        score_rows<kWideRows>(qp, pairs, kp, used_tiles, sc, padded, fetch_pack, ahead);
      else
        score_rows<kRows>(qp, pairs, kp, used_tiles, sc, padded, fetch_pack, ahead);
      float mx[kTileRows], total[kTileRows];
      for (int64_t r = 0; r < nrows; ++r) {
        const int64_t t = (r0 + r) / group;
        std::tie(mx[r], total[r]) = softmax_row(sc + r * padded, lens[t], used_even, static_cast<float>(scale),
                                                pp + r * padded / 2);
      }
      const int64_t key_pairs = used / 2;
#ifdef FASTCPU_AMX
      if (on_tiles)
        value_rows_amx(pp, padded / 2, used_even / 2, vp, d, acc, d, ahead);
      else
#endif
      if (d == 64)
        value_block<4>(pp, padded / 2, key_pairs, vp, acc, d, nrows, ahead);
      else
        value_block<8>(pp, padded / 2, key_pairs, vp, acc, d, nrows, ahead);
      for (int64_t r = 0; r < nrows; ++r) {
        const int64_t t = (r0 + r) / group, head = kvh * group + (r0 + r) % group;
        const float inv = 1.0f / total[r];
        float* o = op + (t * h + head) * d;
        for (int64_t c = 0; c < d; ++c) o[c] = acc[r * d + c] * inv;
        lp[t * h + head] = mx[r] + std::log(total[r]);
      }
    }
  });
  return {out, lse};
#else
  TORCH_CHECK(false, "extend_attention needs AVX512_BF16 (this build targets a CPU without it)");
  return {q};
#endif
}

std::vector<torch::Tensor> extend_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                            torch::Tensor kv_index, torch::Tensor lengths, double scale,
                                            int64_t num_kv_heads, c10::optional<std::vector<torch::Tensor>> packed) {
  return extend_attention(std::move(q), std::move(k_pool), std::move(v_pool), std::move(kv_index),
                          std::move(lengths), scale, num_kv_heads, std::move(packed), nullptr);
}

// A cascade group's rows: `out` [n, H, D] (attention over each row's own KV, with log-sum-exp `lse` [n, H])
// becomes attention over own + shared KV, given the shared part's `o_shared` / `lse_shared`. The shared part's
// weight is sigmoid(lse_shared - lse), runtime/attention/cascade.py has the derivation; fp32 whatever out's dtype,
// rounded once into out's dtype. One pass over the rows in place: the torch expression it replaces (sigmoid, lerp
// and the dtype conversions) was six ATen calls and five temporaries per layer of a decode step, ~12 us of
// dispatch for a few thousand values. The interpolation is torch.lerp's (start + w (end - start) below w = 0.5,
// end - (end - start)(1 - w) from there), so a weight of 0 or 1 gives back one side exactly.
// The layer-by-layer path and the decode stack both merge here, so the two give the same bits.
// (row, head) pairs below which a merge runs on the calling thread (a parallel region costs ~1 us here).
constexpr int64_t kMergeGrain = 256;

void merge_attention(torch::Tensor out, torch::Tensor lse, torch::Tensor o_shared, torch::Tensor lse_shared) {
  TORCH_CHECK(out.dim() == 3 && lse.dim() == 2 && out.sizes() == o_shared.sizes() && lse.sizes() == lse_shared.sizes()
                  && lse.scalar_type() == torch::kFloat32 && lse_shared.scalar_type() == torch::kFloat32
                  && out.size(0) == lse.size(0) && out.size(1) == lse.size(1),
              "merge_attention: out / o_shared [n, H, D], lse / lse_shared [n, H] float32");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16,
              "merge_attention: out must be float32 or bfloat16");
  const torch::Tensor os = o_shared.to(torch::kFloat32).contiguous(), ls = lse_shared.contiguous();
  const int64_t n = out.size(0), h = out.size(1), d = out.size(2);
  const float* osp = os.data_ptr<float>();
  const float* lsp = ls.data_ptr<float>();
  const float* lp = lse.data_ptr<float>();
  // Rows of contiguous values go 16 at a time; the many rows of a prefill step's cascade (7 questions after a
  // few-shot block: 1,400 (row, head) pairs a layer) on both threads, a decode batch's few on the caller's.
  const bool vec = out.stride(2) == 1 && d % 16 == 0;
  const auto merge = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    fastcpu::parallel_for(0, n * h, kMergeGrain, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / h, head = item % h;
        const float w = 1.0f / (1.0f + std::exp(lp[r * lse.stride(0) + head * lse.stride(1)] - lsp[item]));
        T* row = o + r * out.stride(0) + head * out.stride(1);
        const float* shared = osp + item * d;
        if (vec) {
          const v16 wv = splat(w), rest = splat(1.0f - w);
          for (int64_t c = 0; c < d; c += 16) {
            const v16 a = load(row + c), sh = load(shared + c), diff = sh - a;
            store(row + c, w < 0.5f ? a + wv * diff : sh - diff * rest);
          }
          continue;
        }
        for (int64_t c = 0; c < d; ++c) {
          const float a = static_cast<float>(row[c * out.stride(2)]), diff = shared[c] - a;
          row[c * out.stride(2)] = static_cast<T>(w < 0.5f ? a + w * diff : shared[c] - diff * (1.0f - w));
        }
      }
    });
  };
  if (out.scalar_type() == torch::kFloat32)
    merge(out.data_ptr<float>());
  else
    merge(out.data_ptr<at::BFloat16>());
}
