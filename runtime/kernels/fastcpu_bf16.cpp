// linear_bf16: y = x @ W.T for bfloat16 weights with bf16 dot products (AVX512_BF16 vdpbf16ps: 32 bf16
// multiply-adds per instruction, two k values per fp32 lane) instead of widening every weight to fp32.
//
// Why: widening a bf16 weight vector to fp32 costs two instructions (zero-extend, shift) besides the FMA, and
// at several activation rows each widened weight feeds one FMA per row while the k loop advances one value
// at a time; vdpbf16ps takes the weights as they are stored and advances two k values per instruction.
//
// Numerics: the activations are rounded to bf16 (round to nearest even) — exact when the model runs in bf16,
// which is when this kernel is used, since its activations are bf16 tensors already; the products of each k
// pair are summed in fp32 (the instruction's own rounding) into fp32 accumulators. Not bit-equal to
// linear_packed's fp32 FMAs, which nothing promises (deterministic mode runs its own kernels).
//
// Layout (packed.py, "bf16pair"): bf16 [ceil(N/64), ceil(K/2), 128]: per panel of 64 output columns and per
// pair of consecutive k, the 64 columns' two values side by side, so one 512-bit vector is 16 columns x 2 k:
// vdpbf16ps's operand. Padding (k past K, columns past N) holds zeros.
//
// Built only where the compiler targets AVX512_BF16 (-march=native on such a host); bf16_dot() tells.
//
// On CPUs with AMX (fastcpu_amx.h), batches of kAmxMinRows rows or more run on the tiles instead, with K a multiple
// of 32: 16 k pairs of a 16-column slice of a panel are a B tile, the activation pairs an A tile.

#include "fastcpu_amx.h"
#include "fastcpu_vec.h"

namespace {

#ifdef FASTCPU_BF16_DOT

constexpr int64_t kPanel = 64;
constexpr int64_t kPairElems = kPanel * 2;  // bf16 values of one k pair of a panel (256 bytes)
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of the loads the panel is fetched

// The activation rows as bf16 pairs: [rows, ceil(K/2)] 32-bit words (zero past K, and in rows m..rows-1). bf16
// rows are copied as they are (what rounding their fp32 widening to bf16 would give back); fp32 rows are rounded.
std::vector<uint32_t> pair_rows(const torch::Tensor& x, int64_t m, int64_t k, int64_t rows) {
  const int64_t pairs = (k + 1) / 2, ldx = x.stride(0);
  std::vector<uint32_t> out(rows * pairs + 16, 0);
  if (x.scalar_type() == torch::kBFloat16) {
    const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < m; ++r) std::memcpy(out.data() + r * pairs, xb + r * ldx, k * sizeof(at::BFloat16));
    return out;
  }
  const float* xf = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = xf + r * ldx;
    uint32_t* o = out.data() + r * pairs;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) fastcpu::bf16_pairs32(xr + i, o + i / 2);
    for (; i < k; ++i) {
      const __m128bh one = _mm_cvtneps_pbh(_mm_set1_ps(xr[i]));
      uint16_t bits;
      std::memcpy(&bits, &one, 2);
      o[i / 2] |= static_cast<uint32_t>(bits) << (16 * (i % 2));
    }
  }
  return out;
}

// MR rows x the panel's 64 columns (4 vectors of 16). `to_l2`: the panel ahead is asked for into L2 (prefetcht2)
// instead of L1, for products of one or two rows (one light pass per panel): the 120 linears of 30 layers from
// memory took 0.93x the time at 1 row and 0.91-0.95x at 2 (bench_kernel_ab.py, the hints alternated in one
// process, Zen 4 VM), but 1.05-1.26x at 8 rows and 1.13x at 16, where a 6-row pass wants its lines in L1.
template <int MR>
inline void tile(const uint32_t* xp, int64_t pairs, const uint16_t* panel, const fastcpu::ProductDest& out,
                 int64_t cn, const float* bias, bool to_l2) {
  constexpr int NV = 4;
  __m512 acc[MR][NV];
  for (int a = 0; a < MR; ++a)
    for (int v = 0; v < NV; ++v) acc[a][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pairs; ++g) {
    const uint16_t* wg = panel + g * kPairElems;
    const char* ahead = reinterpret_cast<const char*>(wg) + kPrefetchBytes;
    if (to_l2) {
      for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T2);
    } else {
      for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wg + 32 * v);
    for (int a = 0; a < MR; ++a) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[a * pairs + g]));
      for (int v = 0; v < NV; ++v) acc[a][v] = _mm512_dpbf16_ps(acc[a][v], w[v], xb);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t col = 16 * v, left = cn - col;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int a = 0; a < MR; ++a) out.store(a, col, _mm512_add_ps(acc[a][v], bi), mask, std::min<int64_t>(16, left));
  }
}

// Rows come in blocks of up to 6, each taking the whole panel width in one pass (24 accumulators, 4 weight
// vectors and a broadcast fit the 32 vector registers), so each weight vector is loaded once per block. Blocks
// of 8 rows in two half-width passes measured slower at 6, 8 and 12 rows (one core, SmolLM2's shapes).
void linear_bf16_impl(const uint32_t* xp, int64_t m, int64_t pairs, const uint16_t* packed, const float* bias,
                      const fastcpu::ProductDest& dest, int64_t n) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const bool to_l2 = m <= 2;
  fastcpu::parallel_panels(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = packed + p * pairs * kPairElems;
      const int64_t c0 = p * kPanel, cn = std::min<int64_t>(kPanel, n - c0);
      const float* bp = bias ? bias + c0 : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += 6) {
        const uint32_t* xr = xp + r0 * pairs;
        const fastcpu::ProductDest out = dest.at(r0, c0);
        switch (std::min<int64_t>(6, m - r0)) {
          case 6: tile<6>(xr, pairs, panel, out, cn, bp, to_l2); break;
          case 5: tile<5>(xr, pairs, panel, out, cn, bp, to_l2); break;
          case 4: tile<4>(xr, pairs, panel, out, cn, bp, to_l2); break;
          case 3: tile<3>(xr, pairs, panel, out, cn, bp, to_l2); break;
          case 2: tile<2>(xr, pairs, panel, out, cn, bp, to_l2); break;
          default: tile<1>(xr, pairs, panel, out, cn, bp, to_l2); break;
        }
      }
    }
  });
}

#ifdef FASTCPU_AMX

constexpr int64_t kTilePairs = 16;  // k pairs per tile step (32 k values, 64 bytes of a row)
constexpr int64_t kAmxMinRows = 2;
constexpr int64_t kAmxPrefetchBytes = 8192;  // two tile steps of a panel ahead

// Tiles 0-3: the products of `rows` rows x the panel's 4 slices of 16 columns (fp32); 4: the rows' activation
// pairs; 6, 7: weight slices, loaded in turn (fastcpu::products_x4).
fastcpu::TileConfig amx_config(int rows) {
  fastcpu::TileConfig c;
  for (int t = 0; t < 5; ++t) c.tile(t, rows, 64);
  return c.tile(6, kTilePairs, 64).tile(7, kTilePairs, 64);
}

// Rows in blocks of up to 16 (the activations zero-padded to whole blocks, so every block is a full tile and its
// padding rows are computed and dropped); each block takes the panel's 64 columns, k in steps of 16 pairs.
// Needs pairs % 16 == 0 and xp holding fastcpu::amx_padded_rows(m) rows.
void linear_bf16_amx(const uint32_t* xp, int64_t m, int64_t pairs, const uint16_t* packed, const float* bias,
                     const fastcpu::ProductDest& dest, int64_t n) {
  const int rows = static_cast<int>(fastcpu::amx_block_rows(m));
  const int64_t blocks = (m + rows - 1) / rows;
  const fastcpu::TileConfig config = amx_config(rows);
  const int64_t panels = (n + kPanel - 1) / kPanel, lda = pairs * 4, ldb = kPairElems * 2;
  fastcpu::parallel_panels(panels, [&](int64_t p0, int64_t p1) {
    const fastcpu::TileScope tiles(config);
    alignas(64) float c[16 * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = packed + p * pairs * kPairElems;
      const int64_t c0 = p * kPanel, cn = std::min<int64_t>(kPanel, n - c0);
      for (int64_t b = 0; b < blocks; ++b) {
        const uint32_t* a = xp + b * rows * pairs;
        fastcpu::zero_x4();
        for (int64_t g = 0; g < pairs; g += kTilePairs) {
          const uint16_t* w = panel + g * kPairElems;
          // the first block brings the panel in (and the next one's start); the later ones find it in cache
          if (b == 0) {
            const char* ahead = reinterpret_cast<const char*>(w) + kAmxPrefetchBytes;
            for (int line = 0; line < 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
          }
          fastcpu::products_x4<fastcpu::TileDot::kBf16>(a + g, lda, w, ldb);
        }
        fastcpu::store_x4(c, kPanel);
        const fastcpu::ProductDest out = dest.at(b * rows, c0);
        const int64_t valid = std::min<int64_t>(rows, m - b * rows);
        for (int64_t col = 0; col < cn; col += 16) {
          const int64_t left = std::min<int64_t>(16, cn - col);
          const __mmask16 mask = left == 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
          const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + c0 + col) : _mm512_setzero_ps();
          for (int64_t r = 0; r < valid; ++r)
            out.store(r, col, _mm512_add_ps(_mm512_load_ps(c + r * kPanel + col), bi), mask, left);
        }
      }
    }
  });
}

#endif  // FASTCPU_AMX

#endif  // FASTCPU_BF16_DOT

}  // namespace

bool amx_tiles() {
#ifdef FASTCPU_AMX
  return fastcpu::amx_permitted();
#else
  return false;
#endif
}

bool bf16_dot() {
#ifdef FASTCPU_BF16_DOT
  return true;
#else
  return false;
#endif
}

// y = x @ W.T (+ bias) (+= out), W packed as above ([ceil(N/64), ceil(K/2), 128] bfloat16), x float32 or bfloat16
// [M, K]; y in x's dtype (fastcpu::LinearOutput).
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> out) {
#ifdef FASTCPU_BF16_DOT
  fastcpu::check_activation_rows(x);
  const int64_t m = x.size(0), k = x.size(1), pairs = (k + 1) / 2;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == torch::kBFloat16 &&
              packed.size(1) == pairs && packed.size(2) == kPairElems && packed.size(0) * kPanel >= n,
              "packed weight must be bfloat16 [ceil(N/64), ceil(K/2), 128]");
  const float* bp = fastcpu::bias_data(bias, n);
  fastcpu::LinearOutput y(out, x, m, n);
  if (m > 0) {
#ifdef FASTCPU_AMX
    if (m >= kAmxMinRows && pairs % kTilePairs == 0 && fastcpu::amx_permitted()) {
      const std::vector<uint32_t> xp = pair_rows(x, m, k, fastcpu::amx_padded_rows(m));
      linear_bf16_amx(xp.data(), m, pairs, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bp,
                      y.dest(), n);
      return y.finish();
    }
#endif
    const std::vector<uint32_t> xp = pair_rows(x, m, k, m);
    linear_bf16_impl(xp.data(), m, pairs, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bp,
                     y.dest(), n);
  }
  return y.finish();
#else
  TORCH_CHECK(false, "linear_bf16 needs AVX512_BF16 (this build targets a CPU without it)");
  return x;
#endif
}
