// linear_int8 on AMX tiles (CPUs with AMX-INT8, fastcpu_amx.h) with per-block activations: batches of 16+ rows where
// K is a multiple of the activation block and the block is at most 64, but not of 64 (a K of 64s takes the two-part
// activations instead, fastcpu_int8_split.h). One TDPBSUD gives a block's exact int32 sums for up to 16 rows x 16
// columns (the A tile a block of the signed activations, the B tile the block's groups of a 16-column slice), and
// they are folded into fp32 per block exactly as the vector tiles (fastcpu_int8.cpp) fold theirs, so the products
// are the same bits.
#pragma once

#include "fastcpu_amx.h"
#include "fastcpu_int8.h"

namespace fastcpu::int8 {

#ifdef FASTCPU_AMX

// Below 16 rows the vector tiles stay: the tiles' per-block fold (sums stored, converted and scaled) costs more
// than the integer products it saves. One gate/up projection (576 x 3072) in cache, two threads, tiles vs vector
// kernel: 2.64x the time at 2 rows and 1.09x at 8 (a version folding 32 columns at a time, taking batches from 2
// rows), 0.90x at 16, 0.93x at 64, 0.89x at 169. Folding one 16-column slice at a time (amx_slice), the 120
// linears of 30 layers from memory against the vector kernel: 1.32x at 4 rows, 1.13x at 8, 0.99x at 12.
constexpr int64_t kAmxMinRows = 16;
constexpr int64_t kAmxPrefetchBytes = 4096;  // two blocks of a panel ahead (32-value blocks)

constexpr int kAmxRows = 16;  // rows per tile block (xq.q is zero-padded to whole blocks)

// Two sets of tiles, for a block and the next in flight: 0 (even blocks) and 2 (odd) hold a block's int32 sums for
// 16 rows x one 16-column slice; 4 (even) and 5 (odd) the rows' block of activations; 6 (even) and 7 (odd) the
// block's groups of the slice.
inline fastcpu::TileConfig amx_config(int64_t block) {
  fastcpu::TileConfig c;
  c.tile(0, kAmxRows, 64).tile(2, kAmxRows, 64);
  c.tile(4, kAmxRows, static_cast<int>(block)).tile(5, kAmxRows, static_cast<int>(block));
  return c.tile(6, static_cast<int>(block / 4), 64).tile(7, static_cast<int>(block / 4), 64);
}

inline bool amx_fits(int64_t m, int64_t k, int64_t block) {
  return m >= kAmxMinRows && block <= 64 && k % block == 0 && fastcpu::amx_permitted();
}

// One block of 16 rows times one 16-column slice of a panel, stored through `out` (its row 0 is the block's first
// row; `col` the slice's first column, `left` its valid columns): every k-block's int32 sums leave the tiles and
// are folded into 16 fp32 accumulators (one per row) with that block's scales (`scales` [nb][16]: block_scales'
// for this row block). The accumulators stay in registers: with a half panel (32 columns)
// per pass they did not fit, and each block's fold loaded and stored 32 vectors of partial sums besides its two
// tile stores; with one slice a block costs one tile store and 16 loads (0.86-0.89x the time at 169-1,024 rows).
// A block's sums leave the tiles while the next block's dot products run in the other set of tiles: done in turn
// on the same tiles, each block waited for its own store and fold before its successor could start.
inline void amx_slice(const QuantRows& xq, int64_t r0, const uint8_t* slice, int64_t block_bytes, bool prefetch,
               const float* scales, int32_t* sums, const fastcpu::ProductDest& out, int64_t valid, int64_t col,
               int64_t left, const float* scale, const float* bias) {
  const int64_t lda = xq.ld;
  const int8_t* a = xq.q.data() + r0 * lda;
  // One loop with no lambdas: with the fold in a lambda that captured the accumulators by reference, the tile
  // store's "memory" clobber made GCC keep them on the stack, and every fold step loaded and stored its
  // accumulator (in cache, one gate/up slice: ~1.3x the time of the same steps in registers).
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  // Step b issues block b's products (b < nb), then stores and folds block b - 1's sums (b > 0).
  for (int64_t b = 0; b <= xq.nb; ++b) {
    if (b < xq.nb) {
      const uint8_t* w = slice + b * block_bytes;
      if (prefetch) {  // whole k-groups (all four slices of the panel) two blocks ahead
        const char* ahead = reinterpret_cast<const char*>(w) + kAmxPrefetchBytes;
        for (int64_t line = 0; line < block_bytes / 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      }
      // Tile numbers are spelled into the instructions (GCC's tile intrinsics stringify them), so the two sets are
      // two written-out branches rather than one parameterised step.
      if (b % 2 == 0) {
        _tile_zero(0);
        _tile_loadd(4, a + b * xq.block, lda);
        _tile_loadd(6, w, kGroupBytes);
        _tile_dpbsud(0, 4, 6);
      } else {
        _tile_zero(2);
        _tile_loadd(5, a + b * xq.block, lda);
        _tile_loadd(7, w, kGroupBytes);
        _tile_dpbsud(2, 5, 7);
      }
    }
    if (b == 0) continue;
    const int64_t done = b - 1;
    int32_t* s = sums + (done % 2) * 16 * 16;
    if (done % 2 == 0)
      _tile_stored(0, s, 64);
    else
      _tile_stored(2, s, 64);
    const float* sc = scales + done * 16;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s + r * 16)), _mm512_set1_ps(sc[r]), acc[r]);
  }
  const __mmask16 mask = left == 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
  const __m512 sc = _mm512_maskz_loadu_ps(mask, scale + col);
  const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    if (r < valid)
      out.store(r, col, _mm512_fmadd_ps(_mm512_sub_ps(acc[r], _mm512_set1_ps(xq.corr[r0 + r])), sc, bi), mask, left);
}

// The activation scales per block of 16 rows, as amx_slice folds with them: [row blocks][nb][16], zero for rows
// past m (their activations are zero padding).
inline std::vector<float> block_scales(const QuantRows& xq, int64_t m) {
  const int64_t row_blocks = (m + kAmxRows - 1) / kAmxRows;
  std::vector<float> out(row_blocks * xq.nb * kAmxRows, 0.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < xq.nb; ++b)
      out[((r / kAmxRows) * xq.nb + b) * kAmxRows + r % kAmxRows] = xq.scale[r * xq.nb + b];
  return out;
}

// Work items are (panel, chunk of up to 3 row blocks of 16), as linear_int8_impl's. xq.q holds
// fastcpu::amx_padded_rows(m) rows (m >= kAmxMinRows: whole blocks of 16).
inline void linear_int8_amx(const QuantRows& xq, int64_t m, int64_t groups, const uint8_t* packed, const float* scale,
                     const float* bias, const fastcpu::ProductDest& dest, int64_t n) {
  const int64_t row_blocks = (m + kAmxRows - 1) / kAmxRows;
  constexpr int64_t kChunkBlocks = 3;
  const int64_t chunks = (row_blocks + kChunkBlocks - 1) / kChunkBlocks;
  const int64_t panels = (n + kPanel - 1) / kPanel, panel_bytes = groups * kGroupBytes;
  const int64_t block_bytes = xq.block / 4 * kGroupBytes;
  const fastcpu::TileConfig config = amx_config(xq.block);
  const std::vector<float> scales = block_scales(xq, m);
  const auto items = [&](int64_t i0, int64_t i1) {
    const fastcpu::TileScope tiles(config);
    alignas(64) int32_t sums[2 * 16 * 16];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / chunks, rb0 = (i % chunks) * kChunkBlocks;
      const int64_t rb1 = std::min(row_blocks, rb0 + kChunkBlocks);
      const uint8_t* panel = packed + p * panel_bytes;
      const int64_t c0 = p * kPanel, cn = std::min<int64_t>(kPanel, n - c0);
      for (int64_t rb = rb0; rb < rb1; ++rb) {
        const int64_t r0 = rb * kAmxRows, valid = std::min<int64_t>(kAmxRows, m - r0);
        const fastcpu::ProductDest out = dest.at(r0, 0);
        // the first pass over the panel brings it in (and the next one's start); the others find it in cache
        for (int64_t sl = 0; sl * 16 < cn; ++sl)
          amx_slice(xq, r0, panel + 64 * sl, block_bytes, rb == 0 && sl == 0, scales.data() + rb * xq.nb * kAmxRows,
                    sums, out, valid, c0 + 16 * sl, std::min<int64_t>(16, cn - 16 * sl), scale, bias);
      }
    }
  };
  over_items(panels, chunks, items);
}

#endif  // FASTCPU_AMX

}  // namespace fastcpu::int8
