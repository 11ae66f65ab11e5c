// Batch-invariant CPU kernels for --enable-deterministic-inference.
//
// Every output element is computed by one fixed sequence of float operations that depends only on the
// shapes of the row it belongs to (K for a dot product, the row's own KV length for attention), never
// on how many other rows are in the call, where the row sits in it, or how the work is split between
// threads. That is what makes a request's tokens and logprobs independent of the batch it runs in.
//
// How:
// - Dot products accumulate in 8 float lanes (lane i takes k = i, i+8, i+16, ...), then one fixed
//   horizontal sum, then the K % 8 tail in order. Register tiles only choose which dot products run
//   together; each element's operations are the same in every tile shape.
// - Built with -ffp-contract=off and without -ffast-math: a*b+c stays a multiply and an add, and the
//   compiler may not reorder float sums. The 8-lane vectors are GCC vector extensions, so AVX2 and
//   AVX-512 hosts execute the same arithmetic (results are equal across such hosts too, though only
//   invariance within one host is promised).
// - Threads split rows and columns of the output, never a reduction.
// - Attention is a two-pass softmax per (token, head) over the token's own KV positions 0..p in order:
//   a prefill row at position p and a decode row at position p do identical work, whatever chunk,
//   cache hit or batch brought them there.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum8(v8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// The one definition of a dot product of length k: 8 lanes, fixed horizontal sum, ordered tail.
inline float dot(const float* a, const float* b, int64_t k) {
  v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) acc = acc + load8(a + i) * load8(b + i);
  float s = hsum8(acc);
  float tail = 0.f;
  for (; i < k; ++i) tail = tail + a[i] * b[i];
  return s + tail;
}

// MR x NR dot products at once; element (r, c) gets exactly the operations of dot(x_r, w_c, k).
template <int MR, int NR>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* out, int64_t ldo) {
  v8 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = v8{0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    v8 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = load8(x + r * ldx + i);
    for (int c = 0; c < NR; ++c) {
      v8 wv = load8(w + c * ldw + i);
      for (int r = 0; r < MR; ++r) acc[r][c] = acc[r][c] + xv[r] * wv;
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      float s = hsum8(acc[r][c]);
      float tail = 0.f;
      for (int64_t j = i; j < k; ++j) tail = tail + x[r * ldx + j] * w[c * ldw + j];
      out[r * ldo + c] = s + tail;
    }
  }
}

constexpr int kMR = 4;
constexpr int kNR = 4;
constexpr int64_t kColBlock = 64;  // columns of W (64 x K floats) kept hot while every row tile passes

template <int MR>
inline void row_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* out,
                     int64_t ldo, int64_t nr) {
  switch (nr) {
    case 4: tile<MR, 4>(x, ldx, w, ldw, k, out, ldo); break;
    case 3: tile<MR, 3>(x, ldx, w, ldw, k, out, ldo); break;
    case 2: tile<MR, 2>(x, ldx, w, ldw, k, out, ldo); break;
    default: tile<MR, 1>(x, ldx, w, ldw, k, out, ldo); break;
  }
}

inline void any_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* out,
                     int64_t ldo, int64_t mr, int64_t nr) {
  switch (mr) {
    case 4: row_tile<4>(x, ldx, w, ldw, k, out, ldo, nr); break;
    case 3: row_tile<3>(x, ldx, w, ldw, k, out, ldo, nr); break;
    case 2: row_tile<2>(x, ldx, w, ldw, k, out, ldo, nr); break;
    default: row_tile<1>(x, ldx, w, ldw, k, out, ldo, nr); break;
  }
}

void check_f32_2d(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D");
  TORCH_CHECK(t.stride(1) == 1, name, " must have contiguous rows");
}

}  // namespace

// out[m, n] = (residual[m, n] +) (dot(x[m], w[n]) (+ bias[n])). With a residual the result is written into
// it (in place) and returned.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> residual) {
  check_f32_2d(x, "x");
  check_f32_2d(w, "w");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k, "x and w disagree on K");
  torch::Tensor out = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0);
  const int64_t col_blocks = (n + kColBlock - 1) / kColBlock;
  const int64_t row_tiles = (m + kMR - 1) / kMR;
  // Work items: (column block, group of row tiles); the split decides who computes an element, not how.
  const int64_t rows_per_item = std::max<int64_t>(1, std::min<int64_t>(row_tiles, 16));
  const int64_t row_groups = (row_tiles + rows_per_item - 1) / rows_per_item;
  at::parallel_for(0, col_blocks * row_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t cb = item % col_blocks, rg = item / col_blocks;
      const int64_t c0 = cb * kColBlock, c1 = std::min(n, c0 + kColBlock);
      const int64_t r0 = rg * rows_per_item * kMR, r1 = std::min(m, r0 + rows_per_item * kMR);
      for (int64_t r = r0; r < r1; r += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, r1 - r);
        for (int64_t c = c0; c < c1; c += kNR) {
          const int64_t nr = std::min<int64_t>(kNR, c1 - c);
          any_tile(xp + r * ldx, ldx, wp + c * ldw, ldw, k, op + r * n + c, n, mr, nr);
        }
      }
    }
  });
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous(), "bias must be contiguous with N elements");
    const float* bp = bias->data_ptr<float>();
    at::parallel_for(0, m, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t c = 0; c < n; ++c) op[r * n + c] = op[r * n + c] + bp[c];
    });
  }
  if (residual.has_value()) {
    torch::Tensor res = *residual;
    check_f32_2d(res, "residual");
    TORCH_CHECK(res.size(0) == m && res.size(1) == n, "residual must be [M, N]");
    float* rp = res.data_ptr<float>();
    const int64_t ldr = res.stride(0);
    at::parallel_for(0, m, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t c = 0; c < n; ++c) rp[r * ldr + c] = rp[r * ldr + c] + op[r * n + c];
    });
    return res;
  }
  return out;
}

// RMSNorm of each row: x * (1 / sqrt(sum(x^2) / D + eps)) * weight.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_f32_2d(x, "x");
  const int64_t m = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.numel() == d && weight.is_contiguous(), "weight must be contiguous with D elements");
  torch::Tensor out = torch::empty({m, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, m, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * ldx;
      const float ss = dot(row, row, d);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + feps);
      for (int64_t i = 0; i < d; ++i) op[r * d + i] = (row[i] * inv) * wp[i];
    }
  });
  return out;
}

// Rotary embedding of x [T, H, D] (any row stride, contiguous heads): out = x * cos + rotate_half(x) * sin,
// with sin_signed = [-sin, sin] as the model's tables hold it.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32, "x must be float32 [T, H, D]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "x must have contiguous heads");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() && cos.numel() == t * d, "cos/sin must be [T, D]");
  torch::Tensor out = torch::empty({t, h, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t j = 0; j < h; ++j) {
        const float* xh = xp + r * ldx + j * d;
        float* oh = op + (r * h + j) * d;
        for (int64_t i = 0; i < d; ++i) {
          const float rolled = xh[(i + half) % d];
          oh[i] = xh[i] * cp[r * d + i] + rolled * sp[r * d + i];
        }
      }
  });
  return out;
}

// SwiGLU: gate_up [T, 2I] -> silu(gate) * up, [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32_2d(gate_up, "gate_up");
  const int64_t t = gate_up.size(0), inter = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({t, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldg = gate_up.stride(0);
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t i = 0; i < inter; ++i) {
        const float g = gp[r * ldg + i];
        op[r * inter + i] = (g / (1.0f + std::exp(-g))) * gp[r * ldg + inter + i];
      }
  });
  return out;
}

// Attention of each new token over its own KV: token t, head h attends the pool slots
// kv_index[row_start[t] .. row_start[t] + row_len[t] - 1] (positions 0..p of its request, in order) of KV
// head h / (H / Hkv). q [T, H, D]; k_pool, v_pool [S, Hkv, D] contiguous; returns [T, H, D].
torch::Tensor attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor kv_index,
                        torch::Tensor row_start, torch::Tensor row_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q must be contiguous float32 [T, H, D]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3, "KV pools must be contiguous [S, Hkv, D]");
  TORCH_CHECK(kv_index.scalar_type() == torch::kInt64 && row_start.scalar_type() == torch::kInt64 &&
              row_len.scalar_type() == torch::kInt64, "index tensors must be int64");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), hkv = k_pool.size(1);
  TORCH_CHECK(h % hkv == 0 && k_pool.size(2) == d, "head shapes disagree");
  TORCH_CHECK(kv_index.is_contiguous() && row_start.is_contiguous() && row_len.is_contiguous() &&
              row_start.numel() == t && row_len.numel() == t, "row_start and row_len need one entry per token");
  const int64_t group = h / hkv;
  torch::Tensor out = torch::empty({t, h, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* idx = kv_index.data_ptr<int64_t>();
  const int64_t* starts = row_start.data_ptr<int64_t>();
  const int64_t* lens = row_len.data_ptr<int64_t>();
  // the loop below indexes the pool with these slots unchecked: a bad table is an error here, not a stray read
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(starts[r] >= 0 && lens[r] >= 0 && starts[r] + lens[r] <= kv_index.numel(), "row out of kv_index");
    bool outside = false;  // a negative slot wraps to a huge one
    for (int64_t j = 0; j < lens[r]; ++j)
      outside |= static_cast<uint64_t>(idx[starts[r] + j]) >= static_cast<uint64_t>(k_pool.size(0));
    TORCH_CHECK(!outside, "slot out of range");
  }
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t slot_stride = hkv * d;
  at::parallel_for(0, t * h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / h, head = item % h, kvh = head / group;
      const int64_t len = lens[r];
      const int64_t* slots = idx + starts[r];
      const float* qv = qp + (r * h + head) * d;
      scores.resize(len);
      float mx = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const float s = dot(qv, kp + slots[j] * slot_stride + kvh * d, d) * fscale;
        scores[j] = s;
        mx = std::max(mx, s);
      }
      float total = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const float p = std::exp(scores[j] - mx);
        total = total + p;
        const float* vv = vp + slots[j] * slot_stride + kvh * d;
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) store8(acc.data() + i, load8(acc.data() + i) + load8(vv + i) * p);
        for (; i < d; ++i) acc[i] = acc[i] + vv[i] * p;
      }
      float* o = op + (r * h + head) * d;
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < d; ++i) o[i] = acc[i] * inv;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "batch-invariant x @ w.T (+ bias) (+= residual)");
  m.def("rms_norm", &rms_norm, "batch-invariant RMSNorm");
  m.def("rotary", &rotary, "rotary embedding");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("attention", &attention, "batch-invariant attention over each token's own KV");
}
