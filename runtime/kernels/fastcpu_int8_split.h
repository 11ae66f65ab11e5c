// linear_int8 on AMX tiles with two-part activations (CPUs with AMX-INT8, fastcpu_amx.h), every batch size, where K
// is a multiple of 64: each activation row is one scale (max|x| / 127) and two int8 parts, the value rounded to
// the scale's step (hi) and the remainder rounded to 1/254 of a step (lo), so x ~= scale * (hi + lo / 254).
//
// Why: the per-block activations of the vector kernels (fastcpu_int8.cpp) rescale their int32 sums once per
// 32-value block. On the vector units that is a quarter more work than the products; on the tiles it is worse,
// as each block's sums must leave the tiles (a store, 16 loads, a convert and a multiply-add per row) before the
// next block's: at 8 rows the tiles then cost about what the vector kernel does (benchmarks.md, 2026-11-28 and
// 2026-12-01). With one scale per row there is nothing to rescale until the end: each 16-column slice's sums stay
// in a tile over all of K and leave it once. The second part costs one more tile row per activation row, and the
// tiles have them to spare below 16 rows (8 rows are 16 tile rows: one TDPBSUD per 64 k values and 16 columns).
// One scale per row alone (one int8 part) loses too much to outliers (+4-6% perplexity, benchmarks.md); with the
// remainder the activations keep ~15 bits against the row's largest value, finer than the 32-value blocks' 8 bits
// for every block holding a value above 1/127 of that largest.
//
// Numerics: hi = round-half-even(x * 127 / max|x|), lo = round-half-even((x * 127 / max|x| - hi) * 254) (the
// difference is exact in fp32), both in [-127, 127]. The weights are stored offset by +128 (uint8, packed.py), so
// sum_k (w_k + 128) hi_k = sum_k w_k hi_k + 128 sum_k hi_k, exact in int32 (K < 66,000), and likewise for lo; the
// offsets' shares are one integer per row and part. Per output: (hi_sum - 128 sum(hi)) + (lo_sum - 128 sum(lo)) /
// 254 (the offsets taken off in int32, then converted to fp32), times the row's scale, times the weight row's
// scale, plus the bias. A row's result depends on its own activations only: the bits are the same in any batch.
#pragma once

#include "fastcpu_amx.h"
#include "fastcpu_int8.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace fastcpu::int8 {

#ifdef FASTCPU_AMX

constexpr int64_t kSplitStep = 64;  // k values per TDPBSUD (16 k-groups: a B tile's 16 rows)
constexpr int64_t kSplitRows = 8;   // activation rows per tile block (their two parts: 16 tile rows)
constexpr float kLoSteps = 254.0f;  // lo's steps per hi step

// The activation rows as the tiles read them: per block of R rows (R = min(m, 8)) an A tile region of 2R rows of
// ld bytes, hi of the block's rows then their lo; rows past m are zero.
struct SplitRows {
  std::vector<int8_t> q;       // [blocks][2R][ld]
  std::vector<float> scale;    // [m]: max|x| / 127 (0: an all-zero row)
  std::vector<int32_t> hi_offset, lo_offset;  // [m]: 128 sum(hi), 128 sum(lo): the weights' offset's shares
  int64_t ld = 0, rows = 0, blocks = 0;  // rows: R

  // block b's A tile region (2R rows of ld bytes), and row r's two parts in it
  const int8_t* tile(int64_t b) const { return q.data() + b * 2 * rows * ld; }
  int8_t* hi(int64_t r) { return q.data() + (r - r % rows) * 2 * ld + (r % rows) * ld; }
  int8_t* lo(int64_t r) { return hi(r) + rows * ld; }
};

inline bool split_fits(int64_t k) { return k % kSplitStep == 0 && fastcpu::amx_permitted(); }

// Row x[0..k) as hi and lo (above); returns (sum(hi), sum(lo)).
template <typename T>
inline std::pair<int32_t, int32_t> split_row(const T* x, int64_t k, float inv, int8_t* hi, int8_t* lo) {
  __m512i hsum = _mm512_setzero_si512(), lsum = _mm512_setzero_si512();
  const __m512 steps = _mm512_set1_ps(kLoSteps);
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 v = _mm512_mul_ps(load_ps(x + i, 0xFFFF), _mm512_set1_ps(inv));
    const __m512 h = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i hq = _mm512_cvtps_epi32(h);
    const __m512i lq = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, h), steps));
    hsum = _mm512_add_epi32(hsum, hq);
    lsum = _mm512_add_epi32(lsum, lq);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtsepi32_epi8(hq));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), _mm512_cvtsepi32_epi8(lq));
  }
  return {_mm512_reduce_add_epi32(hsum), _mm512_reduce_add_epi32(lsum)};
}

// Rows of x (float or bfloat16, k a multiple of 64) in two parts, on the calling thread (a decode batch's rows take
// a few microseconds) or, for a prefill chunk's many rows, in parallel.
//
// The result is the calling thread's, reused by its next call (the parts in kept_scratch, the per-row vectors
// assigned in their capacity), so a decode step's ~120 calls allocate nothing (four heap allocations each before,
// with the free-chunk merging they cost).
template <typename T>
const SplitRows& split_rows(const T* x, int64_t ldx, int64_t m, int64_t k) {
  thread_local SplitRows kept;
  SplitRows& out = kept;  // this thread's: the lambda below runs on others, where `kept` names their own
  out.ld = k;
  out.rows = std::min<int64_t>(m, kSplitRows);
  out.blocks = (m + out.rows - 1) / out.rows;
  const int64_t bytes = out.blocks * 2 * out.rows * k;
  std::fill_n(fastcpu::kept_scratch(out.q, bytes), bytes, int8_t{0});  // rows past m stay zero
  out.scale.assign(m, 0.f);
  out.hi_offset.assign(m, 0);
  out.lo_offset.assign(m, 0);
  const int64_t grain = std::max<int64_t>(1, 32768 / k);
  fastcpu::parallel_for(0, m, grain, [&](int64_t r_begin, int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      const float mx = block_absmax(x + r * ldx, k);
      if (!(mx > 0.f)) continue;  // an all-zero row stays zero (scale 0)
      const auto [hs, ls] = split_row(x + r * ldx, k, 127.0f / mx, out.hi(r), out.lo(r));
      out.scale[r] = mx / 127.0f;
      out.hi_offset[r] = 128 * hs;
      out.lo_offset[r] = 128 * ls;
    }
  });
  return out;
}

// Tiles 0-3: int32 sums of a row block's 2R tile rows x the four 16-column slices of a panel; 4: the rows' 64 k
// values (hi rows, then lo rows); 6, 7: a slice's 16 k-groups, loaded in turn.
inline fastcpu::TileConfig split_config(int64_t rows) {
  fastcpu::TileConfig c;
  for (int t = 0; t < 5; ++t) c.tile(t, static_cast<int>(2 * rows), 64);
  return c.tile(6, 16, 64).tile(7, 16, 64);
}

// Row r's products for the 16 columns from `col` (of cn valid), from its parts' exact sums against them (the weights'
// offset included), stored as out's row `row`. Both kernels end here, so they give the same bits.
inline void split_store(const SplitRows& xq, int64_t r, __m512i hi_sums, __m512i lo_sums,
                        const fastcpu::ProductDest& out, int64_t row, int64_t col, int64_t cn, const float* scale,
                        const float* bias) {
  const int64_t left = std::min<int64_t>(16, cn - col);
  const __mmask16 mask = left == 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
  const __m512 wsc = _mm512_maskz_loadu_ps(mask, scale + col);
  const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
  // the offsets come off in int32 (exact), so the conversions round the products' sums alone
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi_sums, _mm512_set1_epi32(xq.hi_offset[r])));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo_sums, _mm512_set1_epi32(xq.lo_offset[r])));
  const __m512 t = _mm512_fmadd_ps(lo, _mm512_set1_ps(1.0f / kLoSteps), hi);
  out.store(row, col, _mm512_fmadd_ps(t, _mm512_mul_ps(wsc, _mm512_set1_ps(xq.scale[r])), bi), mask, left);
}

// One row block of a 64-column panel (`groups` k-groups of kGroupBytes, a multiple of 16): the sums over all of K
// stay in tiles 0-3 and are combined and stored once at the end, `valid` rows from out's row 0, columns [0, cn).
inline void split_panel(const SplitRows& xq, int64_t block, const uint8_t* panel, int64_t groups,
                        const fastcpu::ProductDest& out, int64_t r0, int64_t valid, int64_t cn, const float* scale,
                        const float* bias, int32_t* sums) {
  const int8_t* a = xq.tile(block);
  const int64_t step_bytes = 16 * kGroupBytes;  // one step's k-groups of the panel
  fastcpu::zero_x4();
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const uint8_t* w = panel + g0 * kGroupBytes;
    // the panel streams from memory: ask for the step after next (its four slices' 64 lines)
    const char* ahead = reinterpret_cast<const char*>(w) + 2 * step_bytes;
    for (int64_t line = 0; line < step_bytes / 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    fastcpu::products_x4<fastcpu::TileDot::kInt8>(a + g0 * 4, xq.ld, w, kGroupBytes);
  }
  fastcpu::store_x4(sums, kPanel);  // [2R][64]: hi rows, then lo rows
  for (int64_t col = 0; col < cn; col += 16)
    for (int64_t r = 0; r < valid; ++r)
      split_store(xq, r0 + r, _mm512_load_si512(sums + r * kPanel + col),
                  _mm512_load_si512(sums + (xq.rows + r) * kPanel + col), out, r, col, cn, scale, bias);
}

// A lone row (a batch-1 decode step) over a panel on the vector units instead, its two parts two rows of vpdpbusd:
// the same exact sums, so the same bits. At one row the tiles took 1.13-1.19x the per-block vector kernel's time
// over 30 layers' linears (bench_kernel_ab.py; `perf`: three quarters of their samples on the prefetches ahead of
// the weight tiles, whose 16 lines each are 256 bytes apart), though in cache they were faster from one row on.
inline void split_vector_panel(const SplitRows& xq, const uint8_t* panel, int64_t groups,
                               const fastcpu::ProductDest& out, int64_t cn, const float* scale, const float* bias) {
  __m512i hsum[4], lsum[4];
  for (int v = 0; v < 4; ++v) hsum[v] = lsum[v] = _mm512_setzero_si512();
  const int8_t* hi = xq.tile(0);  // one row: R = 1, its hi then its lo
  const int8_t* lo = hi + xq.ld;
  // as the vector kernel's lone pass over a panel: the k-group kPrefetchGroups ahead, into L2
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchGroups * kGroupBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = panel + g * kGroupBytes;
    for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + g * kGroupBytes + 64 * line, _MM_HINT_T2);
    int32_t h4, l4;
    std::memcpy(&h4, hi + 4 * g, 4);
    std::memcpy(&l4, lo + 4 * g, 4);
    const __m512i hb = _mm512_set1_epi32(h4), lb = _mm512_set1_epi32(l4);
    for (int v = 0; v < 4; ++v) {
      const __m512i w = _mm512_loadu_si512(wg + 64 * v);
      hsum[v] = fastcpu::dpbusd(hsum[v], w, hb);
      lsum[v] = fastcpu::dpbusd(lsum[v], w, lb);
    }
  }
  for (int v = 0; v < 4 && 16 * v < cn; ++v) split_store(xq, 0, hsum[v], lsum[v], out, 0, 16 * v, cn, scale, bias);
}

// y = x @ W.T for the split rows: work items are (panel, row block), a panel's blocks together, so that a
// thread keeps its panel in cache across them (linear_int8_impl's split; a decode batch is one block).
inline void linear_int8_split(const SplitRows& xq, int64_t m, int64_t groups, const uint8_t* packed,
                              const float* scale, const float* bias, const fastcpu::ProductDest& dest, int64_t n) {
  const int64_t panels = (n + kPanel - 1) / kPanel, panel_bytes = groups * kGroupBytes;
  if (m == 1) {
    over_items(panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t c0 = p * kPanel;
        split_vector_panel(xq, packed + p * panel_bytes, groups, dest.at(0, c0), std::min<int64_t>(kPanel, n - c0),
                           scale + c0, bias ? bias + c0 : nullptr);
      }
    });
    return;
  }
  const fastcpu::TileConfig config = split_config(xq.rows);
  const auto items = [&](int64_t i0, int64_t i1) {
    const fastcpu::TileScope tiles(config);
    alignas(64) int32_t sums[16 * kPanel];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / xq.blocks, block = i % xq.blocks;
      const int64_t r0 = block * xq.rows, c0 = p * kPanel;
      split_panel(xq, block, packed + p * panel_bytes, groups, dest.at(r0, c0), r0,
                  std::min(xq.rows, m - r0), std::min<int64_t>(kPanel, n - c0), scale + c0, bias ? bias + c0 : nullptr,
                  sums);
    }
  };
  over_items(panels, xq.blocks, items);
}

#endif  // FASTCPU_AMX

}  // namespace fastcpu::int8
