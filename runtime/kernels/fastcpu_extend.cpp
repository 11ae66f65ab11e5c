// extend_attention: many new tokens of one request (a prefill chunk over a cached prefix), or the query rows
// of a cascade group against its shared prefix, attending one row of slots of a KV pool, with AVX512_BF16 dot
// products. The prefix is packed first (fastcpu_pack.cpp), then each block of query rows runs two GEMMs over the
// packs (fastcpu_extend_gemm.h, on AMX's tiles where the CPU has them) around an fp32 softmax (here).
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

#include "fastcpu_amx.h"
#include "fastcpu_attend.h"
#include "fastcpu_extend_gemm.h"
#include "fastcpu_fetch.h"
#include "fastcpu_pack.h"
#include "fastcpu_vec.h"

#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

#ifdef FASTCPU_BF16_DOT

using namespace fastcpu;
using namespace fastcpu::extend;

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

#endif  // FASTCPU_BF16_DOT

}  // namespace

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
  q = fastcpu::heads_side_by_side(q);
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
  const int64_t padded = padded_keys(s);
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
  // The queries are read where they are: a decode stack's are a strided view of its bf16 rotary output, whose
  // values are their own bf16 pairs (a float copy of them was an allocation and a pass per layer).
  const int64_t q_ld = q.stride(0);
  const float* const q_f = q.scalar_type() == torch::kFloat32 ? q.data_ptr<float>() : nullptr;
  const at::BFloat16* const q_b = q_f == nullptr ? q.data_ptr<at::BFloat16>() : nullptr;
  // head `head` of token t as d / 2 words of bf16 pairs (values 2i and 2i + 1), rounded to nearest even from fp32
  const auto query_words = [&](int64_t t, int64_t head, uint32_t* words) {
    if (q_b != nullptr) {
      std::memcpy(words, q_b + t * q_ld + head * d, d * sizeof(at::BFloat16));
      return;
    }
    for (int64_t i = 0; i < d; i += 32) bf16_pairs32(q_f + t * q_ld + head * d + i, words + i / 2);
  };
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
    // Each thread's scratch, kept from call to call (kept_scratch; ~80 KB at a decode group's 12-row blocks, which
    // the heap merged back into its free chunks after every layer): each pass writes what the next one reads, the
    // queries' padding rows are zeroed below.
    thread_local std::vector<uint32_t> qp_buf, pp_buf;
    thread_local std::vector<float> sc_buf, acc_buf;
    uint32_t* const qp = kept_scratch(qp_buf, brows * pairs);
    uint32_t* const pp = kept_scratch(pp_buf, brows * padded / 2);
    float* const sc = kept_scratch(sc_buf, brows * padded);
    float* const acc = kept_scratch(acc_buf, brows * d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / blocks, r0 = (item % blocks) * brows, nrows = std::min<int64_t>(brows, rows - r0);
      const uint16_t* kp = kpack + kvh * padded * d;
      const uint16_t* vp = vpack + kvh * padded * d;
      int64_t max_len = 0;
      std::fill(qp, qp + brows * pairs, 0u);
      for (int64_t r = 0; r < nrows; ++r) {  // row r0 + r: token (r0 + r) / group, query head kvh * group + g
        const int64_t t = (r0 + r) / group, head = kvh * group + (r0 + r) % group;
        uint32_t words[kMaxDim / 2];
        query_words(t, head, words);
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
  // (extend_attention's results are float32 and contiguous already: no dispatch for them)
  const torch::Tensor os = o_shared.scalar_type() == torch::kFloat32 && o_shared.is_contiguous()
                               ? o_shared
                               : o_shared.to(torch::kFloat32).contiguous();
  const torch::Tensor ls = lse_shared.is_contiguous() ? lse_shared : lse_shared.contiguous();
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
        if (vec) {  // fastcpu's names spelled out: this runs on every CPU, outside the BF16 section's using
          const fastcpu::v16 wv = fastcpu::splat(w), rest = fastcpu::splat(1.0f - w);
          for (int64_t c = 0; c < d; c += 16) {
            const fastcpu::v16 a = fastcpu::load(row + c), sh = fastcpu::load(shared + c), diff = sh - a;
            fastcpu::store(row + c, w < 0.5f ? a + wv * diff : sh - diff * rest);
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
