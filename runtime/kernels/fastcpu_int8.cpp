// linear_int8: y = x @ W.T for int8 weights (one fp32 scale per output row) with the activations quantised to
// int8 on the fly, multiplied with integer dot products (AVX512-VNNI vpdpbusd: 64 multiply-adds of 8-bit
// values per instruction into 16 int32 lanes; on CPUs without it AVX2's vpmaddubsw + vpmaddwd, fastcpu_int8_avx2.h)
// instead of converting every weight to float.
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
// Built where the compiler targets AVX512-VNNI or AVX2 (-march=native); int8_dot() tells. On CPUs with AMX, rows of
// K a multiple of 64 (every layer of the default model) take the activations in two parts with one scale per row
// instead of per-block ones (fastcpu_int8_split.h, int8_split() tells), and other batches of 16+ rows run the blocks
// on the tiles (fastcpu_int8_amx.h).

#include "fastcpu_int8.h"
#include "fastcpu_int8_amx.h"
#include "fastcpu_int8_avx2.h"
#include "fastcpu_int8_split.h"

namespace fastcpu::int8 {

#ifdef FASTCPU_VNNI

constexpr int kLanes = 16;  // columns per vector
// Up to 3 rows take the whole panel width in one pass (each weight vector loaded once for all rows); 4..6 rows
// take half of it per pass.
constexpr int64_t kTileRows = 6;
constexpr int tile_passes(int64_t rows) { return rows <= 3 ? 1 : 2; }

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

#endif  // FASTCPU_VNNI

#ifdef FASTCPU_INT8_DOT

// How many passes rows_of_panel makes over a panel for `rows` rows, kTileRows at a time.
constexpr int passes_over_panel(int64_t rows) {
  return static_cast<int>(rows / kTileRows * tile_passes(kTileRows) +
                          (rows % kTileRows > 0 ? tile_passes(rows % kTileRows) : 0));
}

// MR rows of a panel in tile_passes(MR) passes, each over an equal share of the panel's columns. `fetch` says what
// each pass asks for ahead (PanelFetch).
template <int MR>
inline void rows_of_panel(const QuantRows& xq, int64_t r0, int64_t groups, const uint8_t* panel,
                          const fastcpu::ProductDest& out, int64_t cn, const float* scale, const float* bias,
                          fastcpu::PanelFetch& fetch) {
  constexpr int passes = tile_passes(MR), nv = kPanel / kLanes / passes;
  for (int pass = 0; pass < passes; ++pass) {
    const int64_t c0 = pass * nv * kLanes;
    if (c0 >= cn) break;
    if (pass == 0 && fetch.first_of_several()) {
      tile<MR, nv>(xq, r0, groups, panel, c0, out, cn, scale, bias, fetch.first_pass());
    } else {
      tile<MR, nv>(xq, r0, groups, panel, c0, out, cn, scale, bias, fetch.next_pass());
    }
  }
}

// rows_of_panel for the `rows` (1..MR) rows from r0.
template <int MR>
inline void rows_of_panel_upto(int64_t rows, const QuantRows& xq, int64_t r0, int64_t groups, const uint8_t* panel,
                               const fastcpu::ProductDest& out, int64_t cn, const float* scale, const float* bias,
                               fastcpu::PanelFetch& fetch) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_of_panel_upto<MR - 1>(rows, xq, r0, groups, panel, out, cn, scale, bias, fetch);
  }
  rows_of_panel<MR>(xq, r0, groups, panel, out, cn, scale, bias, fetch);
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
      for (int64_t r0 = r_begin; r0 < r_end; r0 += kTileRows)
        rows_of_panel_upto<kTileRows>(std::min<int64_t>(kTileRows, r_end - r0), xq, r0, groups, panel,
                                      dest.at(r0, c0), cn, sp, bp, fetch);
    }
  };
  over_items(panels, chunks, items);
}


#endif  // FASTCPU_INT8_DOT

}  // namespace fastcpu::int8

bool int8_vnni() {
#ifdef FASTCPU_VNNI
  return true;
#else
  return false;
#endif
}

bool int8_split(int64_t k) {
#ifdef FASTCPU_AMX
  return fastcpu::int8::split_fits(k);
#else
  (void)k;
  return false;
#endif
}

bool int8_dot() {
#ifdef FASTCPU_INT8_DOT
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
#ifdef FASTCPU_INT8_DOT
  using namespace fastcpu::int8;
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
#ifdef FASTCPU_AMX
    if (split_fits(k)) {  // two-part activations on AMX hosts (fastcpu_int8_split.h); `block` is not used
      const SplitRows& xs = x.scalar_type() == torch::kBFloat16
                               ? split_rows(x.data_ptr<at::BFloat16>(), x.stride(0), m, k)
                               : split_rows(x.data_ptr<float>(), x.stride(0), m, k);
      linear_int8_split(xs, m, groups, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), bp, y.dest(), n);
      return y.finish();
    }
#endif
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
  TORCH_CHECK(false, "linear_int8 needs AVX2 or AVX512-VNNI (this build targets a CPU without either)");
  return x;
#endif
}
