// linear_int8: y = x @ W.T for int8 weights (one fp32 scale per output row) with the activations quantised to
// int8 on the fly, multiplied with integer dot products (AVX512-VNNI vpdpbusd: 64 multiply-adds of 8-bit
// values per instruction into 16 int32 lanes) instead of converting every weight to float.
//
// Why: converting int8 weights to fp32 costs two instructions per 16 weights besides the FMA, which caps a core
// at ~11 bytes of weights per cycle even from L2: a batch-1 decode step was bound by that arithmetic, not by
// the memory. With vpdpbusd a 64-byte weight vector costs one instruction per activation row.
//
// Numerics. Each activation row is quantised per block of `block` k values (symmetric: scale = max|x| / 127,
// q = round-half-even(x * 127 / max|x|)), so one outlier only coarsens its own block. vpdpbusd multiplies
// unsigned by signed bytes: the weights are stored offset by +128 (uint8, packed.py) and the activations are
// the signed side, so sum_k (w_k + 128) q_k = sum_k w_k q_k + 128 sum_k q_k. Per block the int32 sum is exact
// (no saturation: |sum| <= K * 255 * 127 fits int32 for K < 66,000); blocks are combined in fp32 with their
// scales. The offset's share, sum over blocks of scale * 128 * sum(q), does not depend on the output column, so
// it is one float per row, computed with the quantisation and subtracted once at the end, before one multiply by
// the weight row's scale.
//
// Layout (packed.py, "vnni"): uint8 [ceil(N/64), ceil(K/4), 256]: for each panel of 64 output columns and each
// group of 4 consecutive k, 64 columns x 4 k values (column-major within the group), i.e. one 512-bit vector
// holds 16 columns x 4 k: exactly vpdpbusd's operand. Padding (k past K, columns past N) holds 128 (weight 0).
//
// Built only where the compiler targets AVX512-VNNI (-march=native on such a host); elsewhere int8 weights
// use linear_packed's convert-to-float path (int8_vnni() tells which).
//
// On CPUs with AMX (fastcpu_amx.h), batches of 16+ rows run on the tiles where K is a multiple of the activation
// block and the block is at most 64: one TDPBSUD gives a block's exact int32 sums for up to 16 rows x 16
// columns (the A tile a block of the signed activations, the B tile the block's groups of a 16-column slice), and
// they are folded into fp32 per block exactly as the vector tiles fold theirs, so the products are the same bits.

#include "fastcpu_amx.h"
#include "fastcpu_fetch.h"
#include "fastcpu_ops.h"
#include "fastcpu_vec.h"

namespace {

#ifdef FASTCPU_VNNI

constexpr int64_t kPanel = 64;
constexpr int64_t kGroupBytes = kPanel * 4;  // one k-group of a panel
constexpr int64_t kPrefetchGroups = 16;  // how far ahead (in k-groups, 256 bytes each) the weights are fetched

// The activations quantised per row and block: q [M, ld] int8 (zero past K), scale [M, nb], and each row's
// offset correction corr [M] = sum over its blocks of scale * 128 * sum(q).
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> corr;
  int64_t ld = 0, nb = 0, block = 0;
};

// 16 activations (the lanes of `mask`, zero elsewhere) widened to fp32: bf16 exactly, by a 16-bit shift.
inline __m512 load_ps(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_ps(const at::BFloat16* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Rows of x (float or bfloat16, read as they are: no fp32 copy first) quantised; rows in parallel when there are
// enough of them to pay for a parallel region (a prefill chunk's, not a decode batch's).
template <typename T>
QuantRows quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int64_t block) {
  QuantRows out;
  out.block = block;
  out.nb = (k + block - 1) / block;
  out.ld = out.nb * block;
  out.q.assign(m * out.ld, 0);
  out.scale.assign(m * out.nb, 0.f);
  out.corr.assign(m, 0.f);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1));
  fastcpu::parallel_for(0, m, grain, [&](int64_t r_begin, int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      for (int64_t b = 0; b < out.nb; ++b) {
        const int64_t k0 = b * block, k1 = std::min(k, k0 + block);
        __m512 amax = _mm512_setzero_ps();
        for (int64_t i = k0; i < k1; i += 16) {
          const __mmask16 mask = k1 - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k1 - i)) - 1);
          amax = _mm512_max_ps(amax, _mm512_abs_ps(load_ps(x + r * ldx + i, mask)));
        }
        const float mx = _mm512_reduce_max_ps(amax);
        if (!(mx > 0.f)) continue;  // an all-zero block stays zero (scale 0)
        const __m512 inv = _mm512_set1_ps(127.0f / mx);
        __m512i sum = _mm512_setzero_si512();
        int8_t* qr = out.q.data() + r * out.ld;
        for (int64_t i = k0; i < k1; i += 16) {
          const __mmask16 mask = k1 - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k1 - i)) - 1);
          // cvtps rounds to nearest even (the default MXCSR mode); |x * inv| <= 127 up to rounding, so the
          // saturating narrow only guards against it.
          const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load_ps(x + r * ldx + i, mask), inv));
          sum = _mm512_add_epi32(sum, qi);
          _mm_mask_storeu_epi8(qr + i, mask, _mm512_cvtsepi32_epi8(qi));
        }
        out.scale[r * out.nb + b] = mx / 127.0f;
        out.corr[r] += out.scale[r * out.nb + b] * static_cast<float>(128 * _mm512_reduce_add_epi32(sum));
      }
    }
  });
  return out;
}

// MR rows x NV vectors (16 columns each) of one panel, from column c0 of the panel. Integer accumulators per
// block, folded into fp32 accumulators at each block's end; MR and NV are template constants so that both
// stay in registers (2 * MR * NV + NV + 1 of the 32 zmm registers).
template <int MR, int NV, typename Fetch>
inline void tile(const QuantRows& xq, int64_t r0, int64_t groups, const uint8_t* panel, int64_t c0,
                 const fastcpu::ProductDest& out, int64_t cn, const float* scale, const float* bias,
                 const Fetch& fetch) {
  __m512 facc[MR][NV];
  for (int a = 0; a < MR; ++a)
    for (int v = 0; v < NV; ++v) facc[a][v] = _mm512_setzero_ps();
  const int64_t block_groups = xq.block / 4;
  const int8_t* xrow[MR];
  for (int a = 0; a < MR; ++a) xrow[a] = xq.q.data() + (r0 + a) * xq.ld;
  for (int64_t b = 0; b < xq.nb; ++b) {
    __m512i iacc[MR][NV];
    for (int a = 0; a < MR; ++a)
      for (int v = 0; v < NV; ++v) iacc[a][v] = _mm512_setzero_si512();
    const int64_t g1 = std::min(groups, (b + 1) * block_groups);
    for (int64_t g = b * block_groups; g < g1; ++g) {
      const uint8_t* wg = panel + g * kGroupBytes + c0 * 4;
      fetch.at(g);
      __m512i w[NV];
      for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(wg + 64 * v);
      for (int a = 0; a < MR; ++a) {
        int32_t four;
        std::memcpy(&four, xrow[a] + 4 * g, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int v = 0; v < NV; ++v) iacc[a][v] = fastcpu::dpbusd(iacc[a][v], w[v], xb);
      }
    }
    for (int a = 0; a < MR; ++a) {
      const __m512 s = _mm512_set1_ps(xq.scale[(r0 + a) * xq.nb + b]);
      for (int v = 0; v < NV; ++v) facc[a][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[a][v]), s, facc[a][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t col = c0 + 16 * v, left = cn - col;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 sc = _mm512_maskz_loadu_ps(mask, scale + col);
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int a = 0; a < MR; ++a)
      out.store(a, col, _mm512_fmadd_ps(_mm512_sub_ps(facc[a][v], _mm512_set1_ps(xq.corr[r0 + a])), sc, bi), mask,
                std::min<int64_t>(16, left));
  }
}

// Passes over a (full-width) panel for a tile of `rows` rows (1..6): up to 3 rows take the whole panel width in
// one pass (each weight vector loaded once for all rows); 4..6 rows take half of it per pass.
constexpr int tile_passes(int64_t rows) { return rows <= 3 ? 1 : 2; }

// How many passes rows_of_panel makes over a panel for `rows` rows, 6 at a time.
constexpr int passes_over_panel(int64_t rows) {
  return static_cast<int>(rows / 6 * tile_passes(6) + (rows % 6 > 0 ? tile_passes(rows % 6) : 0));
}

// MR rows of a panel in tile_passes(MR) passes. `fetch` says what each pass asks for ahead (PanelFetch).
template <int MR>
inline void rows_of_panel(const QuantRows& xq, int64_t r0, int64_t groups, const uint8_t* panel,
                          const fastcpu::ProductDest& out, int64_t cn, const float* scale, const float* bias,
                          fastcpu::PanelFetch& fetch) {
  if constexpr (tile_passes(MR) == 1) {
    tile<MR, 4>(xq, r0, groups, panel, 0, out, cn, scale, bias, fetch.next_pass());
  } else {
    if (fetch.first_of_several()) {
      tile<MR, 2>(xq, r0, groups, panel, 0, out, cn, scale, bias, fetch.first_pass());
    } else {
      tile<MR, 2>(xq, r0, groups, panel, 0, out, cn, scale, bias, fetch.next_pass());
    }
    if (cn > 32) tile<MR, 2>(xq, r0, groups, panel, 32, out, cn, scale, bias, fetch.next_pass());
  }
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

void linear_int8_impl(const QuantRows& xq, int64_t m, int64_t groups, const uint8_t* packed, const float* scale,
                      const float* bias, const fastcpu::ProductDest& dest, int64_t n) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // Work items are (panel, chunk of kChunkRows rows), a panel's chunks in a row so that a thread keeps its
  // panel in cache across them: with whole panels only, a 576-column layer's 9 panels split 5 / 4 over two
  // threads at prefill sizes.
  constexpr int64_t kChunkRows = fastcpu::kInt8ChunkRows;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  const int64_t panel_bytes = groups * kGroupBytes;
  const auto items = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / chunks, r_begin = (i % chunks) * kChunkRows, r_end = std::min(m, r_begin + kChunkRows);
      const uint8_t* panel = packed + p * panel_bytes;
      // this thread's next panel (none after its last item; the same panel while its row chunks go on)
      const int64_t p_next = (i + 1) / chunks;
      fastcpu::PanelFetch fetch(i % chunks == 0 ? panel + kPrefetchGroups * kGroupBytes : nullptr,
                                i + 1 < i1 && p_next != p ? packed + p_next * panel_bytes : nullptr, groups,
                                passes_over_panel(r_end - r_begin));
      const int64_t c0 = p * kPanel, cn = std::min<int64_t>(kPanel, n - c0);
      const float* sp = scale + c0;
      const float* bp = bias ? bias + c0 : nullptr;
      for (int64_t r0 = r_begin; r0 < r_end; r0 += 6) {
        const fastcpu::ProductDest out = dest.at(r0, c0);
        switch (std::min<int64_t>(6, r_end - r0)) {
          case 6: rows_of_panel<6>(xq, r0, groups, panel, out, cn, sp, bp, fetch); break;
          case 5: rows_of_panel<5>(xq, r0, groups, panel, out, cn, sp, bp, fetch); break;
          case 4: rows_of_panel<4>(xq, r0, groups, panel, out, cn, sp, bp, fetch); break;
          case 3: rows_of_panel<3>(xq, r0, groups, panel, out, cn, sp, bp, fetch); break;
          case 2: rows_of_panel<2>(xq, r0, groups, panel, out, cn, sp, bp, fetch); break;
          default: rows_of_panel<1>(xq, r0, groups, panel, out, cn, sp, bp, fetch); break;
        }
      }
    }
  };
  over_items(panels, chunks, items);
}

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
fastcpu::TileConfig amx_config(int64_t block) {
  fastcpu::TileConfig c;
  c.tile(0, kAmxRows, 64).tile(2, kAmxRows, 64);
  c.tile(4, kAmxRows, static_cast<int>(block)).tile(5, kAmxRows, static_cast<int>(block));
  return c.tile(6, static_cast<int>(block / 4), 64).tile(7, static_cast<int>(block / 4), 64);
}

bool amx_fits(int64_t m, int64_t k, int64_t block) {
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
void amx_slice(const QuantRows& xq, int64_t r0, const uint8_t* slice, int64_t block_bytes, bool prefetch,
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
std::vector<float> block_scales(const QuantRows& xq, int64_t m) {
  const int64_t row_blocks = (m + kAmxRows - 1) / kAmxRows;
  std::vector<float> out(row_blocks * xq.nb * kAmxRows, 0.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < xq.nb; ++b)
      out[((r / kAmxRows) * xq.nb + b) * kAmxRows + r % kAmxRows] = xq.scale[r * xq.nb + b];
  return out;
}

// Work items are (panel, chunk of up to 3 row blocks of 16), as linear_int8_impl's. xq.q holds
// fastcpu::amx_padded_rows(m) rows (m >= kAmxMinRows: whole blocks of 16).
void linear_int8_amx(const QuantRows& xq, int64_t m, int64_t groups, const uint8_t* packed, const float* scale,
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

#endif  // FASTCPU_VNNI

}  // namespace

bool int8_vnni() {
#ifdef FASTCPU_VNNI
  return true;
#else
  return false;
#endif
}

// y = x @ W.T * scale (+ bias) (+= out), W packed as above ([ceil(N/64), ceil(K/4), 256] uint8), x float32 or
// bfloat16 [M, K] (y in its dtype, fastcpu::LinearOutput) quantised per row in blocks of `block` k values (a
// multiple of 16; 0: one block per row).
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor scale,
                          c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> out, int64_t block) {
#ifdef FASTCPU_VNNI
  fastcpu::check_activation_rows(x);
  const int64_t m = x.size(0), k = x.size(1), groups = (k + 3) / 4;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == torch::kByte &&
              packed.size(1) == groups && packed.size(2) == kGroupBytes && packed.size(0) * kPanel >= n,
              "packed weight must be uint8 [ceil(N/64), ceil(K/4), 256]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() >= n, "bad scale");
  TORCH_CHECK(block >= 0 && block % 16 == 0, "block must be a multiple of 16 (0: whole rows)");
  const float* bp = fastcpu::bias_data(bias, n);
  fastcpu::LinearOutput y(out, x, m, n);
  if (m > 0) {
    const int64_t blk = block == 0 ? std::max<int64_t>(16, (k + 15) / 16 * 16) : block;
    QuantRows xq = x.scalar_type() == torch::kBFloat16
                       ? quantize_rows(x.data_ptr<at::BFloat16>(), x.stride(0), m, k, blk)
                       : quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, blk);
#ifdef FASTCPU_AMX
    if (amx_fits(m, k, blk)) {
      xq.q.resize(fastcpu::amx_padded_rows(m) * xq.ld, 0);  // whole tiles of rows (zeros)
      linear_int8_amx(xq, m, groups, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), bp, y.dest(), n);
      return y.finish();
    }
#endif
    linear_int8_impl(xq, m, groups, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), bp, y.dest(), n);
  }
  return y.finish();
#else
  TORCH_CHECK(false, "linear_int8 needs AVX512-VNNI (this build targets a CPU without it)");
  return x;
#endif
}
