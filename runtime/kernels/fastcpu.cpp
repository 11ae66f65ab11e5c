// Fast CPU kernels for the decode hot path, where a step is bound by memory traffic, not arithmetic.
//
// decode_attention: each decoding request's query heads attend its KV *in place* in the paged pool
//   (fp32 or bf16), through its row of slot indices: no gather of the KV into a padded copy, which at
//   batch 32 over 1k-token contexts cost more than the attention itself. Work is split over (request,
//   KV head, KV range) so that one long request still uses every core; the partial results of a request's
//   ranges are merged by log-sum-exp in a fixed order. The log-sum-exp is returned for cascade merging.
//
// linear_packed: y = x @ W.T over a weight packed k-major in panels of 64 output columns (fp32, bf16, or int8
//   with a per-output scale: weight-only quantization). For decode-sized batches every weight is read from
//   memory once per call and used for all rows while it is in registers, so the call runs at the memory's
//   speed; bf16 and int8 halve and quarter the bytes read. Activations and accumulation are fp32.
//
// Built with -O3 -march=native; 16-float GCC vector extensions compile to AVX-512 where the host has it and
// to pairs of AVX2 instructions elsewhere. Unlike invariant.cpp, nothing here promises batch invariance.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16 load(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  v16u w = __builtin_convertvector(h, v16u) << 16;
  v16 out;
  std::memcpy(&out, &w, sizeof(out));
  return out;
}

inline v16 load(const int8_t* p) {
  // Intrinsics: GCC scalarises __builtin_convertvector from int8 (a byte insert per lane).
#if defined(__AVX512F__)
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  v16 out;
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#endif
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

inline void store(at::BFloat16* p, v16 v) {  // round to nearest even, as torch's float -> bfloat16 cast
  v16u bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16;
  const v16h h = __builtin_convertvector(bits, v16h);
  std::memcpy(p, &h, sizeof(h));
}

// A float rounded through T and back: what storing an intermediate result in T does to it.
inline v16 round_to(v16 v, float*) { return v; }
inline v16 round_to(v16 v, at::BFloat16*) {
  alignas(64) at::BFloat16 tmp[16];
  store(tmp, v);
  return load(tmp);
}

// Transposed horizontal sums: out[t] = sum of the lanes of dp[t], t = 0..15, in four levels of pairwise
// shuffle-and-add (15 merges for 16 sums instead of 16 full reductions). Level w: each input vector holds
// 16/w sources of w partial lanes; a merge halves w and concatenates the sources of its two inputs.
inline v16 merge(v16 x, v16 y, v16i lo, v16i hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

inline v16 hsum16(const v16 (&dp)[16]) {
  const v16i lo16 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi16 = lo16 + 8;
  const v16i lo8 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i hi8 = lo8 + 4;
  const v16i lo4 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i hi4 = lo4 + 2;
  const v16i lo2 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i hi2 = lo2 + 1;
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = merge(dp[2 * i], dp[2 * i + 1], lo16, hi16);
  for (int i = 0; i < 4; ++i) b[i] = merge(a[2 * i], a[2 * i + 1], lo8, hi8);
  for (int i = 0; i < 2; ++i) c[i] = merge(b[2 * i], b[2 * i + 1], lo4, hi4);
  return merge(c[0], c[1], lo2, hi2);
}

// exp of 16 floats (Cephes' expf polynomial, ~1 ulp for |x| < 87); inputs below -87 give ~0.
inline v16 exp16(v16 x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  x = x > splat(88.3f) ? splat(88.3f) : x;
  v16 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v16i ti = __builtin_convertvector(fx, v16i);  // truncates toward zero
  v16 t = __builtin_convertvector(ti, v16);
  v16i over = t > fx;  // truncation went up (negative fx): floor is one less
  ti = ti + over;      // "true" lanes are -1
  t = __builtin_convertvector(ti, v16);
  x = x - t * splat(0.693359375f) - t * splat(-2.12194440e-4f);
  v16 y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * x * x + x + splat(1.0f);
  v16i pow2 = (ti + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &pow2, sizeof(scale));
  return y * scale;
}

constexpr int kTile = 16;  // KV positions scored at once
constexpr int kMaxGroup = 16;  // query heads per KV head handled by the vector path
constexpr int kMaxDim = 256;

// One (request, KV head, position range): online softmax over the range for the G query heads of the KV
// head. Writes the running max, sum and unnormalised output of each head.
template <typename KV>
void attend_range(const float* q, int64_t group, int64_t d, const KV* k_pool, const KV* v_pool,
                  int64_t slot_stride, int64_t head_off, const int64_t* slots, int64_t j0, int64_t j1, float scale,
                  float* m_out, float* l_out, float* acc_out) {
  const int64_t nv = d / 16;
  float m[kMaxGroup], l[kMaxGroup];
  v16 acc[kMaxGroup][kMaxDim / 16];
  v16 qv[kMaxGroup][kMaxDim / 16];
  for (int64_t g = 0; g < group; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    for (int64_t c = 0; c < nv; ++c) {
      acc[g][c] = splat(0.f);
      qv[g][c] = load(q + g * d + c * 16) * splat(scale);
    }
  }
  alignas(64) float s[kMaxGroup][kTile];
  for (int64_t j = j0; j < j1; j += kTile) {
    const int64_t n = std::min<int64_t>(kTile, j1 - j);
    v16 dp[kMaxGroup][kTile];
    for (int64_t t = 0; t < kTile; ++t) {
      if (t >= n) {
        for (int64_t g = 0; g < group; ++g) dp[g][t] = splat(0.f);
        continue;
      }
      const KV* kr = k_pool + slots[j + t] * slot_stride + head_off;
      v16 kc[kMaxDim / 16];
      for (int64_t c = 0; c < nv; ++c) kc[c] = load(kr + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        v16 acc_t = qv[g][0] * kc[0];
        for (int64_t c = 1; c < nv; ++c) acc_t += qv[g][c] * kc[c];
        dp[g][t] = acc_t;
      }
    }
    for (int64_t g = 0; g < group; ++g) store(&s[g][0], hsum16(dp[g]));
    for (int64_t t = n; t < kTile; ++t)
      for (int64_t g = 0; g < group; ++g) s[g][t] = -INFINITY;
    for (int64_t g = 0; g < group; ++g) {
      float tile_max = s[g][0];
      for (int64_t t = 1; t < n; ++t) tile_max = std::max(tile_max, s[g][t]);
      const float new_m = std::max(m[g], tile_max);
      const float correction = std::exp(m[g] - new_m);  // 0 on the first tile (m = -inf)
      m[g] = new_m;
      v16 p = exp16(load(&s[g][0]) - splat(new_m));
      store(&s[g][0], p);
      float tile_sum = 0.f;
      for (int64_t t = 0; t < n; ++t) tile_sum += s[g][t];
      l[g] = l[g] * correction + tile_sum;
      for (int64_t c = 0; c < nv; ++c) acc[g][c] *= splat(correction);
    }
    for (int64_t t = 0; t < n; ++t) {
      const KV* vr = v_pool + slots[j + t] * slot_stride + head_off;
      for (int64_t c = 0; c < nv; ++c) {
        const v16 vc = load(vr + c * 16);
        for (int64_t g = 0; g < group; ++g) acc[g][c] += splat(s[g][t]) * vc;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    m_out[g] = m[g];
    l_out[g] = l[g];
    for (int64_t c = 0; c < nv; ++c) store(acc_out + g * d + c * 16, acc[g][c]);
  }
}

template <typename KV>
std::vector<torch::Tensor> decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_pool,
                                                 const torch::Tensor& v_pool, const torch::Tensor& kv_index,
                                                 const torch::Tensor& row_index, const torch::Tensor& lengths,
                                                 double scale, int64_t hkv) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), group = h / hkv, width = kv_index.size(1);
  const int64_t max_len = lengths.numel() ? lengths.max().item<int64_t>() : 0;
  const int64_t threads = at::get_num_threads();
  // Enough ranges that every core has work even for one request; none shorter than 64 positions.
  int64_t splits = std::max<int64_t>(1, (4 * threads + b * hkv - 1) / (b * hkv));
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, (max_len + 63) / 64));
  auto opts = q.options().dtype(torch::kFloat32);
  torch::Tensor part_m = torch::empty({b, splits, h}, opts);
  torch::Tensor part_l = torch::empty({b, splits, h}, opts);
  torch::Tensor part_acc = torch::empty({b, splits, h, d}, opts);
  const float* qp = q.data_ptr<float>();
  const KV* kp = k_pool.data_ptr<KV>();
  const KV* vp = v_pool.data_ptr<KV>();
  const int64_t* idx = kv_index.data_ptr<int64_t>();
  const int64_t* which = row_index.defined() ? row_index.data_ptr<int64_t>() : nullptr;
  const int64_t* lens = lengths.data_ptr<int64_t>();
  float* pm = part_m.data_ptr<float>();
  float* pl = part_l.data_ptr<float>();
  float* pa = part_acc.data_ptr<float>();
  const int64_t slot_stride = hkv * d;
  at::parallel_for(0, b * hkv * splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t sp = item % splits, kvh = (item / splits) % hkv, r = item / (splits * hkv);
      const int64_t len = lens[r], chunk = (len + splits - 1) / splits;
      const int64_t j0 = std::min(len, sp * chunk), j1 = std::min(len, j0 + chunk);
      const int64_t base = (r * splits + sp) * h + kvh * group;
      if (j0 >= j1) {
        for (int64_t g = 0; g < group; ++g) {
          pm[base + g] = -INFINITY;
          pl[base + g] = 0.f;
          std::fill(pa + (base + g) * d, pa + (base + g + 1) * d, 0.f);
        }
        continue;
      }
      attend_range<KV>(qp + (r * h + kvh * group) * d, group, d, kp, vp, slot_stride, kvh * d, idx + (which ? which[r] : r) * width,
                       j0, j1, static_cast<float>(scale), pm + base, pl + base, pa + base * d);
    }
  });
  torch::Tensor out = torch::empty({b, h, d}, opts);
  torch::Tensor lse = torch::empty({b, h}, opts);
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, b * h, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / h, head = item % h;
      float mx = -INFINITY;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, pm[(r * splits + sp) * h + head]);
      float total = 0.f;
      float* o = op + item * d;
      std::fill(o, o + d, 0.f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t at = (r * splits + sp) * h + head;
        if (pl[at] == 0.f) continue;
        const float w = std::exp(pm[at] - mx);
        total += pl[at] * w;
        for (int64_t i = 0; i < d; ++i) o[i] += pa[at * d + i] * w;
      }
      const float inv = total > 0.f ? 1.0f / total : 0.f;
      for (int64_t i = 0; i < d; ++i) o[i] *= inv;
      lp[item] = mx + std::log(total);
    }
  });
  return {out, lse};
}

constexpr int64_t kPanel = 64;  // output columns per packed panel: 4 vectors of 16

// A tile of MR activation rows x NV vectors (16 columns each) of one panel, starting at column c0 of the
// panel: acc[r][v] = sum_k x[r, k] * P[k, c0 + 16 v .. + 15]. The panel is stored k-major ([K, 64]), so the
// loop streams it and keeps one output column per vector lane (no horizontal sums). MR and NV are template
// constants so the accumulators stay in registers: up to 4 rows take the whole panel width at once (each
// weight loaded and converted once per row tile), 5..8 rows take half of it per pass (16 accumulators).
template <int MR, int NV, typename W>
inline void tile(const float* x, int64_t ldx, int64_t k, const W* panel, int64_t c0, float* y, int64_t ldy,
                 int64_t cn, const float* scale, const float* bias, bool accumulate) {
  v16 acc[MR][NV];
  for (int a = 0; a < MR; ++a)
    for (int v = 0; v < NV; ++v) acc[a][v] = splat(0.f);
  for (int64_t i = 0; i < k; ++i) {
    const W* wk = panel + i * kPanel + c0;
    v16 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load(wk + 16 * v);
    for (int a = 0; a < MR; ++a) {
      const v16 xb = splat(x[a * ldx + i]);
      for (int v = 0; v < NV; ++v) acc[a][v] += xb * w[v];
    }
  }
  alignas(64) float tmp[16 * NV];
  for (int a = 0; a < MR; ++a) {
    for (int v = 0; v < NV; ++v) store(tmp + 16 * v, acc[a][v]);
    float* yr = y + a * ldy;
    for (int64_t c = 0; c < std::min<int64_t>(16 * NV, cn - c0); ++c) {
      float val = tmp[c];
      if (scale) val *= scale[c0 + c];
      if (bias) val += bias[c0 + c];
      yr[c0 + c] = accumulate ? yr[c0 + c] + val : val;
    }
  }
}

template <int MR, typename W>
inline void rows_of_panel(const float* x, int64_t ldx, int64_t k, const W* panel, float* y, int64_t ldy, int64_t cn,
                          const float* scale, const float* bias, bool accumulate) {
  if constexpr (MR <= 4) {
    tile<MR, 4>(x, ldx, k, panel, 0, y, ldy, cn, scale, bias, accumulate);
  } else {
    tile<MR, 2>(x, ldx, k, panel, 0, y, ldy, cn, scale, bias, accumulate);
    if (cn > 32) tile<MR, 2>(x, ldx, k, panel, 32, y, ldy, cn, scale, bias, accumulate);
  }
}

template <typename W>
void linear_packed_impl(const float* x, int64_t ldx, int64_t m, int64_t k, const W* packed, const float* scale,
                        const float* bias, float* y, int64_t ldy, int64_t n, bool accumulate) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = packed + p * k * kPanel;
      const int64_t c0 = p * kPanel, cn = std::min<int64_t>(kPanel, n - c0);
      const float* sp = scale ? scale + c0 : nullptr;
      const float* bp = bias ? bias + c0 : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += 8) {
        const float* xr = x + r0 * ldx;
        float* yr = y + r0 * ldy + c0;
        switch (std::min<int64_t>(8, m - r0)) {
          case 8: rows_of_panel<8>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 7: rows_of_panel<7>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 6: rows_of_panel<6>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 5: rows_of_panel<5>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 4: rows_of_panel<4>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 3: rows_of_panel<3>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          case 2: rows_of_panel<2>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
          default: rows_of_panel<1>(xr, ldx, k, panel, yr, ldy, cn, sp, bp, accumulate); break;
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
  at::parallel_for(0, m, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* row = x + r * ldx;
      v16 acc = splat(0.f);
      for (int64_t i = 0; i < d; i += 16) {
        const v16 v = load(row + i);
        acc += v * v;
      }
      float ss = 0.f;
      for (int i = 0; i < 16; ++i) ss += acc[i];
      const v16 inv = splat(1.0f / std::sqrt(ss / static_cast<float>(d) + eps));
      for (int64_t i = 0; i < d; i += 16)
        store(y + r * d + i, round_to(load(row + i) * inv, static_cast<T*>(nullptr)) * load(w + i));
    }
  });
}

template <typename T>
void silu_mul_impl(const T* gu, int64_t ldg, T* y, int64_t m, int64_t inter) {
  at::parallel_for(0, m, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t i = 0; i < inter; i += 16) {
        const v16 g = load(gu + r * ldg + i);
        const v16 silu = round_to(g / (splat(1.f) + exp16(-g)), static_cast<T*>(nullptr));
        store(y + r * inter + i, silu * load(gu + r * ldg + inter + i));
      }
  });
}

template <typename T>
void rotary_impl(const T* x, int64_t ldx, int64_t heads, int64_t d, const T* cos, const T* sin, T* y, int64_t t) {
  const int64_t half = d / 2;
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + r * ldx + h * d;
        T* yh = y + (r * heads + h) * d;
        for (int64_t i = 0; i < d; i += 16) {
          const v16 prod = round_to(load(xh + i) * load(cos + r * d + i), static_cast<T*>(nullptr));
          store(yh + i, prod + load(xh + (i + half) % d) * load(sin + r * d + i));
        }
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

// Token t (a decode row, or one new token of a short prefill chunk) attends slots
// kv_index[row_index[t], 0 .. lengths[t] - 1] (row_index absent: row t).
std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                            torch::Tensor kv_index, c10::optional<torch::Tensor> row_index,
                                            torch::Tensor lengths, double scale, int64_t num_kv_heads) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be float32 [B, H, D]");
  q = q.contiguous();
  const int64_t h = q.size(1), d = q.size(2);
  TORCH_CHECK(h % num_kv_heads == 0 && h / num_kv_heads <= kMaxGroup, "unsupported head grouping");
  TORCH_CHECK(d % 16 == 0 && d <= kMaxDim, "head dim must be a multiple of 16, at most 256");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.numel() % (num_kv_heads * d) == 0,
              "KV pools must be contiguous [slots, kv_heads * head_dim]");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools differ in dtype");
  TORCH_CHECK(kv_index.dim() == 2 && kv_index.scalar_type() == torch::kInt64 && kv_index.is_contiguous(),
              "kv_index must be contiguous int64 [B, L]");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.numel() == q.size(0), "lengths must be int64 [B]");
  lengths = lengths.contiguous();
  torch::Tensor rows;
  if (row_index.has_value()) {
    rows = row_index->contiguous();
    TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.numel() == q.size(0), "row_index must be int64 [T]");
  } else {
    TORCH_CHECK(kv_index.size(0) == q.size(0), "kv_index needs one row per token without row_index");
  }
  if (k_pool.scalar_type() == torch::kFloat32)
    return decode_attention_impl<float>(q, k_pool, v_pool, kv_index, rows, lengths, scale, num_kv_heads);
  TORCH_CHECK(k_pool.scalar_type() == torch::kBFloat16, "KV pools must be float32 or bfloat16");
  return decode_attention_impl<at::BFloat16>(q, k_pool, v_pool, kv_index, rows, lengths, scale, num_kv_heads);
}

// y = x @ W.T (* scale) (+ bias), W packed by runtime/models/packed.py as [ceil(N/64), K, 64] (float32, bfloat16
// or int8 with a per-output scale). With ``out`` given, the result is added into it in place (a residual).
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> scale,
                            c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x must be float32 [M, K] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == k && packed.size(2) == kPanel &&
              packed.size(0) * kPanel >= n, "packed weight must be [ceil(N/64), K, 64]");
  const float* sp = nullptr;
  const float* bp = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() && scale->numel() >= n, "bad scale");
    sp = scale->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n, "bad bias");
    bp = bias->data_ptr<float>();
  }
  torch::Tensor y;
  if (out.has_value()) {
    y = *out;
    TORCH_CHECK(y.scalar_type() == torch::kFloat32 && y.dim() == 2 && y.size(0) == m && y.size(1) == n &&
                y.stride(1) == 1, "out must be float32 [M, N] with contiguous rows");
  } else {
    y = torch::empty({m, n}, x.options());
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (packed.scalar_type()) {
    case torch::kFloat32:
      linear_packed_impl(xp, x.stride(0), m, k, packed.data_ptr<float>(), sp, bp, yp, y.stride(0), n, out.has_value());
      break;
    case torch::kBFloat16:
      linear_packed_impl(xp, x.stride(0), m, k, packed.data_ptr<at::BFloat16>(), sp, bp, yp, y.stride(0), n,
                         out.has_value());
      break;
    case torch::kChar:
      TORCH_CHECK(sp, "int8 weights need a scale");
      linear_packed_impl(xp, x.stride(0), m, k, packed.data_ptr<int8_t>(), sp, bp, yp, y.stride(0), n, out.has_value());
      break;
    default:
      TORCH_CHECK(false, "packed weights must be float32, bfloat16 or int8");
  }
  return y;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over paged KV read in place; (out, lse)");
  m.def("rms_norm", &rms_norm, "RMSNorm per row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary", &rotary, "rotary position embedding");
  m.def("linear_packed", &linear_packed, "x @ W.T (* scale) (+ bias) (+= out) over a packed weight");
}
