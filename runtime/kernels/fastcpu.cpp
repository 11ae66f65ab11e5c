// Fast CPU kernels for the decode hot path, where a step is bound by memory traffic, not arithmetic.
//
// decode_attention: each decoding request's query heads attend its KV *in place* in the paged pool
//   (fp32, bf16, or the int8 format with a scale per row that store_kv writes), through its row of slot
//   indices: no gather of the KV into a padded copy, which at
//   batch 32 over 1k-token contexts cost more than the attention itself. Work is split over (request,
//   KV head, KV range of 256 positions) so that one long request still uses every core; the partial results
//   of a request's ranges are merged by log-sum-exp in a fixed order. The ranges depend on the request's own
//   length only, so a row's result does not depend on the batch. The log-sum-exp is returned for cascade merging.
//
// linear_packed: y = x @ W.T over a weight packed k-major in panels of 64 output columns (fp32, bf16, or int8
//   with a per-output scale: weight-only quantization). For decode-sized batches every weight is read from
//   memory once per call and used for all rows while it is in registers, so the call runs at the memory's
//   speed; bf16 and int8 halve and quarter the bytes read. Activations and accumulation are fp32. Each panel
//   is prefetched a few k rows ahead (the hardware's prefetchers alone left 1.3-1.7x on the table at 8 rows).
//
// linear_int8 (fastcpu_int8.cpp): int8 weights times activations quantised per row block, with AVX512-VNNI
//   integer dot products (AVX512-VNNI, or AVX2 on CPUs without it; int8_dot()); on AMX hosts, activations in two
//   int8 parts with one scale per row, on the tiles (fastcpu_int8_split.h; int8_split()).
//
// linear_bf16 (fastcpu_bf16.cpp): bf16 weights times bf16 activations with AVX512_BF16 dot products (two k
//   values per instruction and lane, no widening of the weights); built only for CPUs that have them.
//
// extend_attention (fastcpu_extend.cpp): a prefill chunk over a cached prefix, or a cascade group's rows
//   against its shared prefix, as two small bf16 GEMMs per block of query rows; built with linear_bf16.
//   merge_attention joins a cascade row's two parts by their log-sum-exp.
//   pack_prefix (fastcpu_pack.cpp) packs a prefix once for the calls that read it.
//
// store_kv (fastcpu_kv.cpp): new tokens' K and V rows into their pool slots, int8 pools quantised on the way.
//
// DecodeStack (fastcpu_decoder.cpp): every decoder layer of a decode batch in one call from Python, the same
//   kernels in the same order as the layer-by-layer path.
//
// Built with -O3 -march=native; 16-float GCC vector extensions compile to AVX-512 where the host has it and
// to pairs of AVX2 instructions elsewhere, except that without AVX-512 GCC keeps such a vector in memory when it
// lives across loop iterations or goes through a vector select: those loops (argmax, RMSNorm, SiLU·mul, RoPE)
// have AVX2 versions in 8-lane registers. Unlike invariant.cpp, nothing here promises batch invariance.

#include <cstring>

#include "fastcpu_ops.h"
#include "fastcpu_vec.h"

namespace {

using namespace fastcpu;

constexpr int64_t kPanel = 64;  // output columns per packed panel: 4 vectors of 16
constexpr int64_t kPrefetchRows = 8;  // k rows of a panel per pass in a block of several passes (rows_of_panel)
constexpr int64_t kLoneAheadRows = 32;  // how far ahead (in k rows of a panel) a lone pass fetches

// The linear kernel's vectors: 16 floats (one zmm register, 32 of them) with AVX-512, else 8 (one ymm register, 16
// of them). A 16-float GCC vector on AVX2 is two ymm halves that GCC keeps in memory when they sit in arrays: with
// those, an 8-row product ran at 2.7 GB/s of weights against 24 for one row (a Zen 3 host).
#ifdef __AVX512F__
using LinVec = v16;
constexpr int kLanes = 16;
inline LinVec lanes(float x) { return splat(x); }
template <typename W>
inline LinVec load_lanes(const W* p) { return load(p); }
inline void store_lanes(float* p, LinVec v) { store(p, v); }
#else
using LinVec = v8;
constexpr int kLanes = 8;
inline LinVec lanes(float x) { return (LinVec)_mm256_set1_ps(x); }
template <typename W>
inline LinVec load_lanes(const W* p) { return (LinVec)load8(p); }
inline void store_lanes(float* p, LinVec v) { store8(p, (__m256)v); }
#endif

// A tile of MR activation rows x NV vectors (kLanes columns each) of one panel, starting at column c0 of the panel,
// over the panel's k rows [k0, k1): sums[r][c0 + kLanes v ..] += sum_i x[r, i] * P[i, c0 + kLanes v ..], from 0 where
// k0 is 0. The panel is stored k-major ([K, 64]), so the loop streams it and keeps one output column per vector lane
// (no horizontal sums). MR and NV are template constants so the accumulators stay in registers, in the shapes
// rows_of_panel picks for the CPU's registers (each weight is loaded and converted once per pass for all the tile's
// rows). A lone pass (kShares 1) asks for the lines of the row kAhead rows on; a pass over a block with others asks
// for share `share` of kShares of the next block's lines, which starts kAhead rows on; kShares 0 asks for nothing
// (see rows_of_panel).
template <int MR, int NV, int kShares, int64_t kAhead, typename W>
inline void tile(const float* x, int64_t ldx, int64_t k0, int64_t k1, const W* panel, int64_t c0, int share,
                 float* sums) {
  constexpr int kLines = static_cast<int>(sizeof(W)) * kPanel / 64;  // cache lines per k row of a panel
  LinVec acc[MR][NV];
  for (int a = 0; a < MR; ++a)
    for (int v = 0; v < NV; ++v) acc[a][v] = k0 == 0 ? lanes(0.f) : load_lanes(sums + a * kPanel + c0 + kLanes * v);
  for (int64_t i = k0; i < k1; ++i) {
    const W* wk = panel + i * kPanel + c0;
    if constexpr (kShares == 0) {
      // the second tile shape of a block: the first shape's passes asked for the next block
    } else if constexpr (kShares == 1) {
      const char* next = reinterpret_cast<const char*>(panel + (i + kAhead) * kPanel);
      for (int line = 0; line < kLines; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    } else {  // the next block's lines in address order: this pass's step j of all passes' kShares * kAhead
      const char* next = reinterpret_cast<const char*>(panel + (k0 + kAhead) * kPanel);
      const int64_t j = share * kAhead + (i - k0);
      for (int64_t line = j * kLines / kShares; line < (j + 1) * kLines / kShares; ++line)
        _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    }
    LinVec w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load_lanes(wk + kLanes * v);
    for (int a = 0; a < MR; ++a) {
      const LinVec xb = lanes(x[a * ldx + i]);
      for (int v = 0; v < NV; ++v) acc[a][v] += xb * w[v];
    }
  }
  for (int a = 0; a < MR; ++a)
    for (int v = 0; v < NV; ++v) store_lanes(sums + a * kPanel + c0 + kLanes * v, acc[a][v]);
}

// The register tiles (accumulators + one pass's weight vectors + the broadcast row value, within the registers):
// with AVX-512 up to 4 rows take the whole panel width at once (16 accumulators), 5..8 rows half of it per pass.
// With AVX2 one row takes the whole width (its weights are FMA operands straight from memory), two rows half of it
// per pass, and 3..6 rows a quarter (12 accumulators). Each output's sum runs over k in the same order in every
// tile shape, so a row's bits do not depend on the shape its batch picked.
#ifdef __AVX512F__
constexpr int64_t kTileRows = 8;
#else
constexpr int64_t kTileRows = 6;
// Batches of up to this many rows take their panels in one sweep of two tile shapes (6 rows and the rest:
// rows_of_panel). On the Zen 3 host, the 120 fp32 linears from memory against a sweep per shape: 0.79-0.81x the time
// at 8 rows, 0.83x at 7, 0.86x at 9, 0.95-0.97x at 10; 12 rows (6 + 6) 0.94-1.04x, so from 11 rows the shapes
// sweep in turn; a batch of 14 or 16 doing its last 8 or 10 rows this way, from L2 after the first 6 rows' sweep,
// 0.99x and 1.04x.
constexpr int64_t kTwoShapeRows = 10;
#endif

// Columns per pass of a tile of `rows` rows (the register tiles above), and its passes over a panel.
constexpr int columns_per_pass(int rows) {
  return kLanes == 16 ? (rows <= 4 ? 64 : 32) : (rows == 1 ? 64 : rows == 2 ? 32 : 16);
}
constexpr int passes_per_panel(int rows) { return rows == 0 ? 0 : static_cast<int>(kPanel) / columns_per_pass(rows); }

// MR rows of a panel, and MR2 more (0: none) in a second tile shape over the same blocks.
//
// The passes over a panel go block by block: kPrefetchRows * (MR's passes) k rows, all passes, then the next block,
// the running sums kept in `sums` between blocks. Each of MR's passes asks for its share of the lines of the next
// block, so the memory streams the next block while all passes compute this one. Before, the first pass over the
// whole panel asked for all of its lines and the other passes re-read them from L2: the memory was busy in the
// first pass only, and fp32 products at 8 rows ran at a quarter of the FMA roof on an AVX2 host. The shares go in
// address order (pass p asks for the p-th part of the block's bytes, a line per row it computes), not by column
// (pass p asking for its own line of each row): on a Zen 3 host the 120 fp32 linears at 6 and 8 rows from memory
// took 1.05-1.07x the time with the column-wise order. A block's sums go to `sums` as vector stores: a memcpy of
// each accumulator compiled to a copy through the stack with AVX2, ~15% of an 8-row product with its weights in L2.
//
// The second shape (AVX2's 7-10 rows: 6 + 1..4, kTwoShapeRows) runs its passes over each block right after the
// first's, while the block is in L1 and the next one streams in; it asks for nothing itself. Before, it swept the
// whole panel again after the first shape, from L2, with the memory idle.
//
// One pass (one row, or up to 4 with AVX-512) takes the whole panel as one block, fetching kLoneAheadRows ahead
// (2 KB of fp32 weights ahead, as before, took 1.05-1.07x the time at one row from memory on the Zen 3 host). Every
// pass runs over all 64 columns of the panel (a partial panel's are zero-padded); only the first cn are stored.
template <int MR, int MR2, typename W>
inline void rows_of_panel(const float* x, int64_t ldx, int64_t k, const W* panel, float* y, int64_t ldy, int64_t cn,
                          const float* scale, const float* bias, bool accumulate) {
  constexpr int kColumns = columns_per_pass(MR), kColumns2 = MR2 > 0 ? columns_per_pass(MR2) : 0;
  constexpr int kPasses = passes_per_panel(MR), kPasses2 = passes_per_panel(MR2);
  constexpr bool kLone = kPasses + kPasses2 == 1;  // one pass in all: the whole panel is one block
  constexpr int64_t kAhead = kLone ? kLoneAheadRows : kPrefetchRows * kPasses;
  const int64_t block = kLone ? k : kAhead;
  alignas(64) float sums[MR + MR2][kPanel];
  if (k == 0) std::fill(&sums[0][0], &sums[0][0] + (MR + MR2) * kPanel, 0.f);  // no k rows: no block sets the sums
  for (int64_t k0 = 0; k0 < k; k0 += block) {
    const int64_t k1 = std::min(k, k0 + block);
    for (int pass = 0; pass < kPasses; ++pass)
      tile<MR, kColumns / kLanes, kPasses, kAhead>(x, ldx, k0, k1, panel, pass * kColumns, pass, &sums[0][0]);
    if constexpr (MR2 > 0)
      for (int pass = 0; pass < kPasses2; ++pass)
        tile<MR2, kColumns2 / kLanes, 0, kAhead>(x + MR * ldx, ldx, k0, k1, panel, pass * kColumns2, pass,
                                                &sums[MR][0]);
  }
  for (int a = 0; a < MR + MR2; ++a) {
    float* yr = y + a * ldy;
    for (int64_t c = 0; c < cn; ++c) {
      float val = sums[a][c];
      if (scale) val *= scale[c];
      if (bias) val += bias[c];
      yr[c] = accumulate ? yr[c] + val : val;
    }
  }
}

template <typename W>
void linear_packed_impl(const float* x, int64_t ldx, int64_t m, int64_t k, const W* packed, const float* scale,
                        const float* bias, float* y, int64_t ldy, int64_t n, bool accumulate) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  fastcpu::parallel_panels(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = packed + p * k * kPanel;
      const int64_t c0 = p * kPanel, cn = std::min<int64_t>(kPanel, n - c0);
      const float* sp = scale ? scale + c0 : nullptr;
      const float* bp = bias ? bias + c0 : nullptr;
      for (int64_t r0 = 0, rows = 0; r0 < m; r0 += rows) {
        const float* xr = x + r0 * ldx;
        float* yr = y + r0 * ldy + c0;
        rows = std::min<int64_t>(kTileRows, m - r0);
#ifndef __AVX512F__
        if (m > kTileRows && m <= kTwoShapeRows) rows = m;  // 7-10 rows in one sweep of two tile shapes
#endif
        switch (rows) {
#ifdef __AVX512F__
          case 8: rows_of_panel<8, 0>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 7: rows_of_panel<7, 0>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
#else
          case 10: rows_of_panel<6, 4>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 9: rows_of_panel<6, 3>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 8: rows_of_panel<6, 2>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 7: rows_of_panel<6, 1>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
#endif
          case 6: rows_of_panel<6, 0>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 5: rows_of_panel<5, 0>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 4: rows_of_panel<4, 0>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 3: rows_of_panel<3, 0>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 2: rows_of_panel<2, 0>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          default: rows_of_panel<1, 0>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
        }
      }
    }
  });
}


// ---------------------------------------------------------------------------------------------- fused small ops
// The elementwise and per-row work of a layer in one pass each (instead of 3-6 ATen ops), in the model's
// dtype T (float or bfloat16, computed in fp32 with T's rounding where torch's ops round).

template <typename T>
void rms_norm_impl(const T* x, int64_t ldx, const T* w, T* y, int64_t m, int64_t d, float eps) {
  fastcpu::parallel_for(0, m, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* row = x + r * ldx;
      float ss = 0.f;
#ifdef __AVX512F__
      v16 acc = splat(0.f);
      for (int64_t i = 0; i < d; i += 16) {
        const v16 v = load(row + i);
        acc += v * v;
      }
      for (int i = 0; i < 16; ++i) ss += acc[i];
      const v16 inv = splat(1.0f / std::sqrt(ss / static_cast<float>(d) + eps));
      for (int64_t i = 0; i < d; i += 16)
        store(y + r * d + i, round_to(load(row + i) * inv, static_cast<T*>(nullptr)) * load(w + i));
#else
      // The same sums in two registers (lanes 0-7 and 8-15 of the 16-lane accumulator): GCC keeps a 16-float vector
      // that lives across iterations in memory without AVX-512, a store-forwarding stall per step (1.4 ns a value).
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        const __m256 a = load8(row + i), c = load8(row + i + 8);
        lo = _mm256_fmadd_ps(a, a, lo);  // acc += v * v contracts to this FMA (-ffp-contract=fast)
        hi = _mm256_fmadd_ps(c, c, hi);
      }
      alignas(32) float lanes[16];
      _mm256_store_ps(lanes, lo);
      _mm256_store_ps(lanes + 8, hi);
      for (float v : lanes) ss += v;
      const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(d) + eps));
      for (int64_t i = 0; i < d; i += 8)
        store8(y + r * d + i, _mm256_mul_ps(round8(_mm256_mul_ps(load8(row + i), inv), static_cast<T*>(nullptr)),
                                            load8(w + i)));
#endif
    }
  });
}

template <typename T>
void silu_mul_impl(const T* gu, int64_t ldg, T* y, int64_t m, int64_t inter) {
  fastcpu::parallel_for(0, m, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
#ifdef __AVX512F__
      for (int64_t i = 0; i < inter; i += 16) {
        const v16 g = load(gu + r * ldg + i);
        const v16 silu = round_to(g / (splat(1.f) + exp16(-g)), static_cast<T*>(nullptr));
        store(y + r * inter + i, silu * load(gu + r * ldg + inter + i));
      }
#else
      // one register at a time: GCC lowers exp16's 16-lane selects to scalar code without AVX-512 (3.2 ms for
      // [1024, 3072] on a Zen 3 host); the arithmetic per lane is the same
      const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
      for (int64_t i = 0; i < inter; i += 8) {
        const __m256 g = load8(gu + r * ldg + i);
        const __m256 e = exp8(_mm256_xor_ps(g, sign));
        const __m256 silu = round8(_mm256_div_ps(g, _mm256_add_ps(one, e)), static_cast<T*>(nullptr));
        store8(y + r * inter + i, _mm256_mul_ps(silu, load8(gu + r * ldg + inter + i)));
      }
#endif
    }
  });
}

template <typename T>
void rotary_impl(const T* x, int64_t ldx, int64_t heads, int64_t d, const T* cos, const T* sin, T* y, int64_t t) {
  const int64_t half = d / 2;
  // 32 rows a chunk: a decode batch's few rows (8 x 12 heads: ~6k values) run on the calling thread, where a
  // parallel region cost more than the rotation (6-8 us a layer against ~1)
  fastcpu::parallel_for(0, t, 32, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + r * ldx + h * d;
        T* yh = y + (r * heads + h) * d;
#ifdef __AVX512F__
        for (int64_t i = 0; i < d; i += 16) {
          const v16 prod = round_to(load(xh + i) * load(cos + r * d + i), static_cast<T*>(nullptr));
          store(yh + i, prod + load(xh + (i + half) % d) * load(sin + r * d + i));
        }
#else
        // one register at a time, the partner half without a division: GCC spilled each 16-lane result to the
        // stack and divided for every 16 values (2.4 ns a value at one row). The FMA is the one the 16-lane code
        // compiled to: in fp32 x * cos fused and the partner's product rounded, in bf16 x * cos rounded first.
        for (int64_t i = 0; i < d; i += 8) {
          const int64_t partner = i < half ? i + half : i - half;
          const __m256 x = load8(xh + i), c = load8(cos + r * d + i), xp = load8(xh + partner);
          const __m256 sn = load8(sin + r * d + i);
          if constexpr (std::is_same_v<T, float>)
            store8(yh + i, _mm256_fmadd_ps(x, c, _mm256_mul_ps(xp, sn)));
          else
            store8(yh + i, _mm256_fmadd_ps(xp, sn, round8(_mm256_mul_ps(x, c), static_cast<T*>(nullptr))));
        }
#endif
      }
  });
}

template <typename F>
void dispatch_float(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kFloat32) {
    f(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(t.scalar_type() == torch::kBFloat16, "expected float32 or bfloat16");
    f(static_cast<at::BFloat16*>(nullptr));
  }
}

}  // namespace

// y = x @ W.T (* scale) (+ bias), W packed by runtime/models/packed.py as [ceil(N/64), K, 64] (float32, bfloat16
// or int8 with a per-output scale); x float32 or bfloat16, y in x's dtype. With ``out`` given, the result is added
// into it in place (a residual; fastcpu::LinearOutput).
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> scale,
                            c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> out) {
  const torch::Tensor xf = fastcpu::float_rows(x);
  const int64_t m = xf.size(0), k = xf.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == k && packed.size(2) == kPanel &&
              packed.size(0) * kPanel >= n, "packed weight must be [ceil(N/64), K, 64]");
  const float* sp = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() && scale->numel() >= n, "bad scale");
    sp = scale->data_ptr<float>();
  }
  const float* bp = fastcpu::bias_data(bias, n);
  fastcpu::LinearOutput y(out, x, m, n);
  const float* xp = xf.data_ptr<float>();
  const int64_t ldx = xf.stride(0);
  switch (packed.scalar_type()) {
    case torch::kFloat32:
      linear_packed_impl(xp, ldx, m, k, packed.data_ptr<float>(), sp, bp, y.data(), y.ld(), n, y.accumulate());
      break;
    case torch::kBFloat16:
      linear_packed_impl(xp, ldx, m, k, packed.data_ptr<at::BFloat16>(), sp, bp, y.data(), y.ld(), n, y.accumulate());
      break;
    case torch::kChar:
      TORCH_CHECK(sp, "int8 weights need a scale");
      linear_packed_impl(xp, ldx, m, k, packed.data_ptr<int8_t>(), sp, bp, y.data(), y.ld(), n, y.accumulate());
      break;
    default:
      TORCH_CHECK(false, "packed weights must be float32, bfloat16 or int8");
  }
  return y.finish();
}


// RMSNorm of each row of x [M, D] (contiguous rows, D a multiple of 16): HF's order (normalise in fp32, round
// to the dtype, times the weight).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 16 == 0, "x must be [M, D], D % 16 == 0");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "weight must match x");
  torch::Tensor y = torch::empty_like(x, at::MemoryFormat::Contiguous);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_impl<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), y.data_ptr<T>(), x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
  return y;
}

// [gate | up] [T, 2I] -> silu(gate) * up [T, I] (I a multiple of 16).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 32 == 0, "gate_up must be [T, 2I]");
  const int64_t inter = gate_up.size(1) / 2;
  torch::Tensor y = torch::empty({gate_up.size(0), inter}, gate_up.options());
  dispatch_float(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_impl<T>(gate_up.data_ptr<T>(), gate_up.stride(0), y.data_ptr<T>(), gate_up.size(0), inter);
  });
  return y;
}

// RoPE: x [T, H, D] (any row stride, contiguous heads; D % 32 == 0), cos / sin_signed [T, D] -> [T, H, D].
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 32 == 0,
              "x must be [T, H, D] with contiguous heads, D % 32 == 0");
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
              cos.numel() == x.size(0) * x.size(2), "cos / sin must be contiguous [T, D] in x's dtype");
  torch::Tensor y = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rotary_impl<T>(x.data_ptr<T>(), x.stride(0), x.size(1), x.size(2), cos.data_ptr<T>(), sin_signed.data_ptr<T>(),
                   y.data_ptr<T>(), x.size(0));
  });
  return y;
}

// Each of 16 lanes' first maximum over row[0 .. i) (lane c sees positions c, c + 16, ...; i = v rounded down to
// 16) into best / at, and whether any of those values is a NaN.
#ifdef __AVX512F__
inline bool lane_maxima(const float* row, int64_t i, float* best_out, int32_t* at_out) {
  v16 best = splat(-INFINITY);
  v16i at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, here = at;
  v16i nan = here - here;  // lanes that saw a NaN (all ones)
  for (int64_t j = 0; j < i; j += 16, here += 16) {
    const v16 a = load(row + j);
    nan |= a != a;
    const v16i up = a > best;  // strictly greater: a lane keeps its first maximum
    best = up ? a : best;
    at = up ? here : at;
  }
  store(best_out, best);
  std::memcpy(at_out, &at, sizeof(at));
  bool any_nan = false;
  for (int c = 0; c < 16; ++c) any_nan |= nan[c] != 0;
  return any_nan;
}
#else
// Without AVX-512, GCC lowers the 16-lane selects above to scalar code (one row of 49,152 logits: 172 us on a Zen
// 3 core); the same steps in two 8-lane registers take 5 us.
inline bool lane_maxima(const float* row, int64_t i, float* best_out, int32_t* at_out) {
  __m256 best0 = _mm256_set1_ps(-INFINITY), best1 = best0, nan = _mm256_setzero_ps();
  __m256i here0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), here1 = _mm256_add_epi32(here0, _mm256_set1_epi32(8));
  __m256i at0 = here0, at1 = here1;
  const __m256i step = _mm256_set1_epi32(16);
  for (int64_t j = 0; j < i; j += 16) {
    const __m256 a0 = _mm256_loadu_ps(row + j), a1 = _mm256_loadu_ps(row + j + 8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a0, a1, _CMP_UNORD_Q));  // a lane of either is a NaN
    const __m256 up0 = _mm256_cmp_ps(a0, best0, _CMP_GT_OQ), up1 = _mm256_cmp_ps(a1, best1, _CMP_GT_OQ);
    best0 = _mm256_blendv_ps(best0, a0, up0);
    best1 = _mm256_blendv_ps(best1, a1, up1);
    at0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at0), _mm256_castsi256_ps(here0), up0));
    at1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at1), _mm256_castsi256_ps(here1), up1));
    here0 = _mm256_add_epi32(here0, step);
    here1 = _mm256_add_epi32(here1, step);
  }
  _mm256_storeu_ps(best_out, best0);
  _mm256_storeu_ps(best_out + 8, best1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_out), at0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_out + 8), at1);
  return _mm256_movemask_ps(nan) != 0;
}
#endif

// The index of each row's first maximum of fp32 logits [N, V], NaN counting as the largest (torch.max's answer):
// a greedy decode step's token. torch.max over [8, 49152] took 0.1-0.25 ms on the AVX-512 host (a scalar compare
// per element); here 16 lanes each keep their first maximum and the lanes are reduced once per row.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1 &&
              logits.size(1) > 0, "logits must be float32 [N, V] (V > 0) with contiguous rows");
  const int64_t n = logits.size(0), v = logits.size(1), ld = logits.stride(0);
  torch::Tensor out = torch::empty({n}, logits.options().dtype(torch::kInt64));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  fastcpu::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * ld;
      const int64_t i = v / 16 * 16;
      alignas(64) float best[16];
      alignas(64) int32_t at[16];
      const bool any_nan = lane_maxima(row, i, best, at);
      int64_t pick = -1;
      if (any_nan) {  // rare: the first NaN, found again
        for (int64_t j = 0; j < i && pick < 0; ++j)
          if (row[j] != row[j]) pick = j;
      } else {
        float m = best[0];
        int64_t idx = at[0];
        for (int c = 1; c < 16; ++c)
          if (best[c] > m || (best[c] == m && at[c] < idx)) {
            m = best[c];
            idx = at[c];
          }
        for (int64_t j = i; j < v; ++j) {  // the tail, after every lane's positions
          if (row[j] != row[j]) {
            idx = j;
            break;
          }
          if (row[j] > m) {
            m = row[j];
            idx = j;
          }
        }
        pick = idx;
      }
      o[r] = pick;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over paged KV read in place; (out, lse)");
  m.def("argmax_rows", &argmax_rows, "each row's first maximum of fp32 logits, NaN the largest (as torch.max)");
  m.def("store_kv", &store_kv, "new tokens' K and V rows into their pool slots");
  m.def("rms_norm", &rms_norm, "RMSNorm per row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary", &rotary, "rotary position embedding");
  m.def("linear_packed", &linear_packed, "x @ W.T (* scale) (+ bias) (+= out) over a packed weight");
  m.def("linear_int8", &linear_int8, "x @ W.T over int8 weights in the vnni layout, x quantised per row block");
  m.def("int8_vnni", &int8_vnni, "whether the int8 KV pool's attention uses VNNI dot products (AVX512-VNNI)");
  m.def("int8_split", &int8_split, "whether linear_int8 multiplies rows of k values as two-part activations with one "
        "scale per row (AMX), rather than per-block ones");
  m.def("int8_dot", &int8_dot, "whether linear_int8 was built (AVX512-VNNI, or AVX2 on CPUs without it)");
  m.def("linear_bf16", &linear_bf16, "x @ W.T over bf16-pair-packed weights with bf16 dot products");
  // the overload without a fetch plan (the one with one is the decode stack's)
  using ExtendAttention = std::vector<torch::Tensor> (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                                         torch::Tensor, double, int64_t,
                                                         c10::optional<std::vector<torch::Tensor>>);
  m.def("extend_attention", static_cast<ExtendAttention>(&extend_attention),
        "many tokens of one request against one row of bf16 KV slots with bf16 dot products; (out, lse)",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("kv_index"), py::arg("lengths"), py::arg("scale"),
        py::arg("num_kv_heads"), py::arg("packed") = py::none());
  m.def("pack_prefix", &pack_prefix, "one layer's KV of a slot row packed for extend_attention; (K, V)");
  m.def("merge_attention", &merge_attention,
        "a cascade group's own-KV attention (out, lse) merged in place with its shared prefix's");
  m.def("bf16_dot", &bf16_dot, "whether linear_bf16 was built (the CPU has AVX512_BF16)");
  m.def("amx_tiles", &amx_tiles, "whether linear_bf16 and linear_int8 run batches on AMX tiles (the CPU has AMX)");
  bind_decoder(m);
}
