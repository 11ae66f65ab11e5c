// The two small GEMMs of extend_attention (fastcpu_extend.cpp) over a pack (fastcpu_pack.h): a block of query rows'
// scores against the K tiles, and the probabilities' weighted sum of the V pairs, with AVX512_BF16 dot products or,
// on CPUs with AMX (fastcpu_amx.h), on the tiles over the same packs: 16 dim pairs of a key tile are a B tile of the
// scores (rows of 64 bytes, contiguous), 16 key pairs x 16 dims of the values one of the value sum; the queries
// (row-major) and the probabilities are the A tiles.
#pragma once

#include "fastcpu_amx.h"
#include "fastcpu_fetch.h"
#include "fastcpu_pack.h"
#include "fastcpu_vec.h"

#ifdef FASTCPU_BF16_DOT

namespace fastcpu::extend {

// Query rows per block of the score pass: 8 (x 3 key tiles = 24 accumulators), or 12 (x 2 tiles) where that splits
// the blocks more evenly between the threads (see block_rows). A row's result does not depend on its block.
constexpr int kRows = 8;
constexpr int kWideRows = 12;
constexpr int kTileRows = 16;  // on the tiles (AMX) only: a whole A tile of query rows
constexpr int kPvRows = 4;  // query rows per pass of the value sum (4 rows x D/16 accumulators)

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
inline fastcpu::TileConfig attention_tiles(int rows) {
  fastcpu::TileConfig c;
  for (int t = 0; t < 5; ++t) c.tile(t, rows, 64);
  return c.tile(6, 16, 64).tile(7, 16, 64);
}

// Scores of the block's rows (queries row-major: qrow [rows][pairs], pairs a multiple of 16) against key tiles
// [0, tiles), unscaled, into sc. A kept pack comes from memory: the next 4 key tiles are asked for while these run.
inline void score_rows_amx(const uint32_t* qrow, int64_t pairs, const uint16_t* kp, int64_t tiles, float* sc, int64_t ldsc,
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
inline void value_rows_amx(const uint32_t* pp, int64_t ldp, int64_t key_pairs, const uint16_t* vp, int64_t d, float* out,
                           int64_t ldo, FetchCursor& fetch) {
  const int64_t ldv = d * 4;  // bytes from one key pair's values to the next's
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    fastcpu::zero_x4();
    for (int64_t jp0 = 0; jp0 < key_pairs; jp0 += 16) {
      for (int tick = 0; tick < 16; ++tick) fetch.tick();
      fastcpu::products_x4<fastcpu::TileDot::kBf16>(pp + jp0, ldp * 4, vp + (jp0 * d + c0) * 2, ldv);
    }
    fastcpu::store_x4(out + c0, ldo);
  }
}

#endif  // FASTCPU_AMX

}  // namespace fastcpu::extend

#endif  // FASTCPU_BF16_DOT
