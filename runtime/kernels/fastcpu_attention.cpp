// Decode attention over the paged KV pool read in place (see fastcpu.cpp for the module's overview).

#include "fastcpu_attend.h"
#include "fastcpu_attend_avx2.h"
#include "fastcpu_attend_dot.h"
#include "fastcpu_ops.h"

namespace {

using namespace fastcpu;
using namespace fastcpu::attend;

// One (KV row, KV head, position range): online softmax over the range for G query heads that share the KV
// head — the head's query heads of one token, or of several tokens of one request (a verified draft, a short
// prefill chunk), so that each K and V row is loaded once for all of them. Head g sees positions below hi[g]
// (its token's length). Writes the running max, sum and unnormalised output of
// each head. A head's arithmetic is the same whichever heads share its call: tiles past its length are skipped
// for it, and positions past its length within a tile get weight exactly 0 — so a token's result does not
// depend on which tokens it was batched with.
//
// G (query heads per KV head) and NV (head dim / 16) are template constants for the common shapes (0: taken
// from the arguments): with fixed trip counts the compiler unrolls the head and dim loops and keeps the
// accumulators and queries in vector registers instead of reloading them from the stack for every position,
// which made the general version ~3x slower than it needs to be. The arithmetic and its order are the same
// in every instance, so results do not depend on which one runs.
//
// An int8 pool (KV = int8_t) is read as it is stored: a position's score is its row's scale times the dot product
// with the int8 values widened to float, and its weight in the value sum is multiplied by the V row's scale, so the
// values are never dequantised into a copy.
template <typename KV, int G, int NV>
void attend_range(const float* q, int64_t group_arg, int64_t d, const KV* k_pool, const KV* v_pool,
                  int64_t slot_stride, int64_t head_off, const int64_t* slots, int64_t j0, int64_t j1, float scale,
                  const int64_t* hi, float* m_out, float* l_out, float* acc_out) {
  const int64_t group = G > 0 ? G : group_arg;
  const int64_t nv = NV > 0 ? NV : d / 16;
  const int64_t pf_len = prefetch_length<KV>(head_off, slot_stride, d);
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
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  alignas(64) float s[kMaxGroup][kTile];
  alignas(64) float k_scale[kTile];
  for (int64_t j = j0; j < j1; j += kTile) {
    const int64_t n = std::min<int64_t>(kTile, j1 - j);
    v16 dp[kMaxGroup][kTile];
    for (int64_t t = 0; t < kTile; ++t) {
      if (t >= n) {
        for (int64_t g = 0; g < group; ++g) dp[g][t] = splat(0.f);
        if constexpr (kInt8) k_scale[t] = 0.f;
        continue;
      }
      const KV* kr = k_pool + slots[j + t] * slot_stride + head_off;
      if (j + kPrefetch + t < j1) prefetch_row(k_pool + slots[j + kPrefetch + t] * slot_stride + head_off, pf_len);
      if constexpr (kInt8) k_scale[t] = row_scale(kr, d);
      v16 kc[kMaxDim / 16];
      for (int64_t c = 0; c < nv; ++c) kc[c] = load(kr + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        v16 acc_t = qv[g][0] * kc[0];
        for (int64_t c = 1; c < nv; ++c) acc_t += qv[g][c] * kc[c];
        dp[g][t] = acc_t;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      if constexpr (kInt8)
        store(&s[g][0], hsum16(dp[g]) * load(k_scale));
      else
        store(&s[g][0], hsum16(dp[g]));
    }
    for (int64_t t = n; t < kTile; ++t)
      for (int64_t g = 0; g < group; ++g) s[g][t] = -INFINITY;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t ng = std::min<int64_t>(n, hi[g] - j);  // positions of this tile head g sees
      if (ng <= 0) {  // past this head's token: the tile does not exist for it
        for (int64_t t = 0; t < kTile; ++t) s[g][t] = 0.f;
        continue;
      }
      float tile_max = s[g][0];
      for (int64_t t = 1; t < ng; ++t) tile_max = std::max(tile_max, s[g][t]);
      const float new_m = std::max(m[g], tile_max);
      const float correction = rescale(m[g], new_m);
      m[g] = new_m;
      v16 p = exp16(load(&s[g][0]) - splat(new_m));
      store(&s[g][0], p);
      for (int64_t t = ng; t < n; ++t) s[g][t] = 0.f;
      float tile_sum = 0.f;
      for (int64_t t = 0; t < ng; ++t) tile_sum += s[g][t];
      l[g] = l[g] * correction + tile_sum;
      if (correction != 1.f)
        for (int64_t c = 0; c < nv; ++c) acc[g][c] *= splat(correction);
    }
    for (int64_t t = 0; t < n; ++t) {
      const KV* vr = v_pool + slots[j + t] * slot_stride + head_off;
      if (j + kPrefetch + t < j1) prefetch_row(v_pool + slots[j + kPrefetch + t] * slot_stride + head_off, pf_len);
      if constexpr (kInt8) {
        const float v_scale = row_scale(vr, d);
        for (int64_t c = 0; c < nv; ++c) {
          const v16 vc = load(vr + c * 16);
          for (int64_t g = 0; g < group; ++g) acc[g][c] += splat(s[g][t] * v_scale) * vc;
        }
      } else {
        for (int64_t c = 0; c < nv; ++c) {
          const v16 vc = load(vr + c * 16);
          for (int64_t g = 0; g < group; ++g) acc[g][c] += splat(s[g][t]) * vc;
        }
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
using AttendFn = void (*)(const float*, int64_t, int64_t, const KV*, const KV*, int64_t, int64_t, const int64_t*,
                          int64_t, int64_t, float, const int64_t*, float*, float*, float*);

// The (heads, head dim / 16) shapes compiled for every kernel: head dims 64 and 128 with the head counts that
// grouped-query models give alone or for a few tokens at once. The portable kernel has three more.
#define FASTCPU_ATTEND_SHAPES(CASE) \
  CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(6, 4) CASE(8, 4) CASE(9, 4) CASE(12, 4) \
  CASE(1, 8) CASE(2, 8) CASE(4, 8) CASE(8, 8)

// The instance for G heads of dim 16 * nv: a dot-product kernel where the pool, the queries and the CPU allow,
// else the AVX2 kernel on a CPU without AVX-512 (head dims 64 and 128), else attend_range's for the shape, else the
// general attend_range.
template <typename KV>
AttendFn<KV> pick_attend(int64_t heads, int64_t nv, bool bf16_queries) {
#ifdef FASTCPU_BF16_DOT
  if constexpr (std::is_same_v<KV, at::BFloat16>) {
    if (bf16_queries) {
#define FASTCPU_ATTEND_BF16(g, n) \
  if (heads == (g) && nv == (n)) return &attend_range_bf16<g, n>;
      FASTCPU_ATTEND_SHAPES(FASTCPU_ATTEND_BF16)
#undef FASTCPU_ATTEND_BF16
    }
  }
#else
  (void)bf16_queries;
#endif
#ifdef FASTCPU_VNNI
  if constexpr (std::is_same_v<KV, int8_t>) {
#define FASTCPU_ATTEND_I8(g, n) \
  if (heads == (g) && nv == (n)) return &attend_range_i8<g, n>;
    FASTCPU_ATTEND_SHAPES(FASTCPU_ATTEND_I8)
#undef FASTCPU_ATTEND_I8
  }
#endif
#ifndef __AVX512F__
  if (nv == 4) return &attend_range_avx2<KV, 8>;
  if (nv == 8) return &attend_range_avx2<KV, 16>;
#endif
#define FASTCPU_ATTEND_CASE(g, n) \
  if (heads == (g) && nv == (n)) return &attend_range<KV, g, n>;
  FASTCPU_ATTEND_SHAPES(FASTCPU_ATTEND_CASE)
  FASTCPU_ATTEND_CASE(15, 4) FASTCPU_ATTEND_CASE(16, 4) FASTCPU_ATTEND_CASE(16, 8)
#undef FASTCPU_ATTEND_CASE
#undef FASTCPU_ATTEND_SHAPES
  return &attend_range<KV, 0, 0>;
}

// Runs of consecutive tokens that read the same KV row (the draft tokens of one request, a short prefill
// chunk), at most kMaxGroup query heads per KV head in all: they are attended together.
struct Segment {
  int64_t first, count, max_len;
};

std::vector<Segment> segments(const int64_t* which, const int64_t* lens, int64_t b, int64_t group) {
  const int64_t cap = std::max<int64_t>(1, kSegmentHeads / group);
  std::vector<Segment> out;
  for (int64_t t = 0; t < b; ++t) {
    Segment* last = out.empty() ? nullptr : &out.back();
    if (which && last && last->count < cap && which[last->first] == which[t]) {
      last->count += 1;
      last->max_len = std::max(last->max_len, lens[t]);
    } else {
      out.push_back({t, 1, lens[t]});
    }
  }
  return out;
}

// A work item: one range of positions for the query heads of one segment, or of several segments whose rows hold
// the same slots over the range (requests under a shared cached prefix: a few-shot batch, parallel samples). The
// range's K and V rows are then addressed and fetched once for all of them, and each head's pass finds them in L1.
// A head's arithmetic does not depend on the heads it shares a call with (attend_range's contract), so sharing
// changes no bit.
struct Item {
  int64_t sp = 0, j0 = 0, j1 = 0, heads = 0, count = 0;
  const int64_t* slots = nullptr;  // the first segment's row of the table, read for all of them
  int64_t seg[kMaxCallHeads] = {};
};

// The most query heads share_ranges puts in one call. The AVX2 kernel scores a tile's rows one pass of heads at a
// time from L1, so more heads only amortise the rows' addressing and fetches: 8 rows of 3 heads under a shared
// 1,050-position prefix (fp32 pool, 30 layers from memory, Zen 3) took 0.74x the time of a call per row with 3 rows
// (9 heads) to a call, 0.93x that with 5 (15), and 0.94x again with all 8 (24). The register-tiled kernels are
// compiled for shapes up to kSegmentHeads, the most a several-token draft measured fastest with.
inline int64_t max_shared_heads(int64_t nv) {
#ifndef __AVX512F__
  if (nv == 4 || nv == 8) return kMaxCallHeads;  // pick_attend's AVX2 kernel
#endif
  (void)nv;
  return kSegmentHeads;
}

// Items of every (segment, range), ranges in order: a segment joins an earlier item of its range when their ranges
// end at the same position and their rows' slots over it are equal, as long as the heads fit one call.
std::vector<Item> share_ranges(const std::vector<Segment>& segs, int64_t splits, int64_t group, int64_t nv,
                               const int64_t* idx, const int64_t* which, int64_t width) {
  const int64_t cap = max_shared_heads(nv);
  std::vector<Item> items;
  for (int64_t sp = 0; sp < splits; ++sp) {
    const size_t open = items.size();  // this range's items start here
    for (int64_t s = 0; s < static_cast<int64_t>(segs.size()); ++s) {
      const Segment& seg = segs[s];
      const int64_t j0 = std::min(seg.max_len, sp * kRange), j1 = std::min(seg.max_len, j0 + kRange);
      const int64_t heads = seg.count * group;
      const int64_t* row = idx + (which ? which[seg.first] : seg.first) * width;  // the segment's table row
      const int64_t* mine = row + j0;
      Item* into = nullptr;
      for (size_t i = open; i < items.size() && j0 < j1 && into == nullptr; ++i) {
        Item& it = items[i];
        if (it.j0 == j0 && it.j1 == j1 && it.heads + heads <= cap &&
            std::equal(mine, mine + (j1 - j0), it.slots + j0))
          into = &it;
      }
      if (into == nullptr) {
        items.push_back({sp, j0, j1, 0, 0, row, {}});
        into = &items.back();
      }
      into->seg[into->count++] = s;
      into->heads += heads;
    }
  }
  return items;
}

// q: float32 or bfloat16 with contiguous heads (rows of any stride); the output is written in q's dtype (the
// model's activations).
template <typename KV>
std::vector<torch::Tensor> decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_pool,
                                                 const torch::Tensor& v_pool, const torch::Tensor& kv_index,
                                                 const torch::Tensor& row_index, const torch::Tensor& lengths,
                                                 double scale, int64_t hkv) {
  const torch::ScalarType out_dtype = q.scalar_type();
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), group = h / hkv, width = kv_index.size(1);
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const int64_t max_len = b ? *std::max_element(lens, lens + b) : 0;
  // The output is in q's dtype, so a bfloat16 output means bf16 queries: exact as vdpbf16ps operands.
  const bool bf16_queries = out_dtype == torch::kBFloat16;
  // Ranges of kRange positions from each row's start, whatever the batch: a row's arithmetic (its ranges and
  // their merge order) depends on its own length only, so a decode row gives the same bits alone, in a batch
  // or as one of a verified draft's rows (speculative decoding's outputs equal those without). One long row
  // still spreads over the cores (1,000 positions: 4 ranges per KV head).
  const int64_t splits = std::max<int64_t>(1, (max_len + kRange - 1) / kRange);
  auto opts = q.options().dtype(torch::kFloat32);
  torch::Tensor out = torch::empty({b, h, d}, opts.dtype(out_dtype));
  torch::Tensor lse = torch::empty({b, h}, opts);
  float* lp = lse.data_ptr<float>();
  float* const out_f = out_dtype == torch::kFloat32 ? out.data_ptr<float>() : nullptr;
  at::BFloat16* const out_b = out_dtype == torch::kFloat32 ? nullptr : out.data_ptr<at::BFloat16>();
  // One range per row (every row within kRange positions: a decode batch's own parts under a cascade group, short
  // contexts): each head's range is its result, written as the merge below would write it (the merge of one part
  // multiplies by exp(0) = 1 and adds to 0, which change no bit), without the parts' buffers and the merge's pass:
  // at batch 8 under a cascade group, a parallel region and three allocations less in each layer.
  const bool one_range = splits == 1;
  // A head's result (row `item` of out and lse) from its weighted value sum o, its weights' sum and their max.
  const auto finish = [&](int64_t item, const float* o, float total, float mx) {
    const float inv = total > 0.f ? 1.0f / total : 0.f;
    for (int64_t i = 0; i < d; i += 16) {
      const v16 v = load(o + i) * splat(inv);
      if (out_f != nullptr)
        store(out_f + item * d + i, v);
      else
        store(out_b + item * d + i, v);
    }
    lp[item] = mx + std::log(total);
  };
  // the ranges' parts, merged below: none for one range per row
  torch::Tensor part_m, part_l, part_acc;
  if (!one_range) {
    part_m = torch::empty({b, splits, h}, opts);
    part_l = torch::empty({b, splits, h}, opts);
    part_acc = torch::empty({b, splits, h, d}, opts);
  }
  // The queries are read where they are, in their dtype (bf16 widens exactly): a decode stack's are a strided view
  // of its bf16 rotary output, and a float copy of them was an allocation and a pass per layer.
  const int64_t q_ld = q.stride(0);
  const float* const q_f = out_dtype == torch::kFloat32 ? q.data_ptr<float>() : nullptr;
  const at::BFloat16* const q_b = out_dtype == torch::kFloat32 ? nullptr : q.data_ptr<at::BFloat16>();
  // n query heads of token t from `head` on, as fp32, into dst
  const auto queries = [&](int64_t t, int64_t head, int64_t n, float* dst) {
    if (q_f != nullptr) {
      std::copy(q_f + t * q_ld + head * d, q_f + t * q_ld + (head + n) * d, dst);
      return;
    }
    const at::BFloat16* src = q_b + t * q_ld + head * d;
    for (int64_t i = 0; i < n * d; i += 16) store(dst + i, load(src + i));
  };
  const KV* kp = k_pool.data_ptr<KV>();
  const KV* vp = v_pool.data_ptr<KV>();
  const int64_t* idx = kv_index.data_ptr<int64_t>();
  const int64_t* which = row_index.defined() ? row_index.data_ptr<int64_t>() : nullptr;
  float* pm = one_range ? nullptr : part_m.data_ptr<float>();
  float* pl = one_range ? nullptr : part_l.data_ptr<float>();
  float* pa = one_range ? nullptr : part_acc.data_ptr<float>();
  const int64_t row = d + (std::is_same_v<KV, int8_t> ? 4 : 0);  // a head's row: its values (and int8 scale)
  const int64_t slot_stride = hkv * row;
  const std::vector<Segment> segs = segments(which, lens, b, group);
  // A work item is one range of one or more segments, all KV heads in turn: the heads' values of a KV position are
  // side by side in its slot, so the later heads find the range's slots in cache (one measurement, a batch-1 step
  // over a 1k-token context from memory: 1.56 -> 1.38 ms over 30 layers against one item per head).
  const std::vector<Item> items = share_ranges(segs, splits, group, d / 16, idx, which, width);
  // Each position's own work in an item (its rows' addresses, fetches and softmax), in query heads' worth: from one
  // item of 3 heads and one of 24 over 256 positions on one core of a Zen 3 host.
  constexpr int64_t kPositionHeads = 4;
  const auto item_cost = [&](int64_t i) {  // positions of the range times the heads that attend them, and their own
    return (items[i].j1 - items[i].j0) * (items[i].heads + kPositionHeads) + 1;  // + 1: an empty range costs a little
  };
  parallel_dealt_by_cost(static_cast<int64_t>(items.size()), item_cost, [&](const int64_t* dealt, int64_t count) {
    // on the stack, not the heap: four allocations a thread in every call otherwise
    alignas(64) float qs[kMaxCallHeads * kMaxDim], accs[kMaxCallHeads * kMaxDim], ms[kMaxCallHeads], ls[kMaxCallHeads];
    int64_t hi[kMaxCallHeads];
    for (int64_t n = 0; n < count; ++n) {
      const Item& it = items[dealt[n]];
      const int64_t sp = it.sp, j0 = it.j0, j1 = it.j1;
      const AttendFn<KV> attend = pick_attend<KV>(it.heads, d / 16, bf16_queries);
      // the item's tokens in turn (each segment's consecutive tokens), each with its length for its query heads
      int64_t token[kMaxCallHeads], tokens = 0;
      for (int64_t m = 0; m < it.count; ++m)
        for (int64_t i = 0; i < segs[it.seg[m]].count; ++i) token[tokens++] = segs[it.seg[m]].first + i;
      for (int64_t i = 0; i < tokens; ++i)
        for (int64_t g = 0; g < group; ++g) hi[i * group + g] = lens[token[i]];
      for (int64_t kvh = 0; kvh < hkv; ++kvh) {
        for (int64_t i = 0; i < tokens; ++i)  // this KV head's query heads of each token, side by side
          queries(token[i], kvh * group, group, qs + i * group * d);
        if (j0 < j1)
          attend(qs, it.heads, d, kp, vp, slot_stride, kvh * row, it.slots, j0, j1, static_cast<float>(scale), hi, ms,
                 ls, accs);
        for (int64_t i = 0; i < tokens; ++i) {
          const int64_t r = token[i], base = (r * splits + sp) * h + kvh * group;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t x = i * group + g;
            const bool empty = j0 >= std::min(lens[r], j1);  // no position of this range for this token
            if (one_range) {  // base + g is (r, head): the output's row
              alignas(64) float o[kMaxDim];
              // 0 + acc, as the merge's sum starts: a -0 becomes +0 there too
              for (int64_t c = 0; c < d; c += 16) store(o + c, empty ? splat(0.f) : splat(0.f) + load(accs + x * d + c));
              finish(base + g, o, empty ? 0.f : ls[x], empty ? -INFINITY : ms[x]);
              continue;
            }
            pm[base + g] = empty ? -INFINITY : ms[x];
            pl[base + g] = empty ? 0.f : ls[x];
            if (empty)
              std::fill(pa + (base + g) * d, pa + (base + g + 1) * d, 0.f);
            else
              std::copy(accs + x * d, accs + (x + 1) * d, pa + (base + g) * d);
          }
        }
      }
    }
  });
  if (one_range) return {out, lse};
  fastcpu::parallel_for(0, b * h, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float o[kMaxDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / h, head = item % h;
      float mx = -INFINITY;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, pm[(r * splits + sp) * h + head]);
      float total = 0.f;
      std::fill(o, o + d, 0.f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t at = (r * splits + sp) * h + head;
        if (pl[at] == 0.f) continue;
        const float w = std::exp(pm[at] - mx);
        total += pl[at] * w;
        for (int64_t i = 0; i < d; ++i) o[i] += pa[at * d + i] * w;
      }
      finish(item, o, total, mx);
    }
  });
  return {out, lse};
}

}  // namespace

// Every slot a decode call reads lies in a pool of `total_slots` rows: each token's row of kv_index exists, its
// length fits the row, and the slots it covers are in range. The kernel indexes the pool with them unchecked, so
// a bad table would read outside the pool instead of failing; one pass over the used slots costs a few
// microseconds per call (the decode stack makes it once per step, not once per layer).
void check_decode_slots(const torch::Tensor& kv_index, const c10::optional<torch::Tensor>& row_index,
                        const torch::Tensor& lengths, int64_t total_slots) {
  TORCH_CHECK(kv_index.dim() == 2 && kv_index.scalar_type() == torch::kInt64 && kv_index.is_contiguous(),
              "kv_index must be contiguous int64 [B, L]");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.dim() == 1, "lengths must be int64 [T]");
  const torch::Tensor lens = lengths.contiguous();
  torch::Tensor rows;
  if (row_index.has_value()) {
    rows = row_index->contiguous();
    TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.numel() == lens.numel(), "row_index must be int64 [T]");
  } else {
    TORCH_CHECK(kv_index.size(0) == lens.numel(), "kv_index needs one row per token without row_index");
  }
  const int64_t width = kv_index.size(1), table_rows = kv_index.size(0);
  const int64_t* index = kv_index.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* rp = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t t = 0; t < lens.numel(); ++t) {
    const int64_t r = rp ? rp[t] : t;
    TORCH_CHECK(r >= 0 && r < table_rows, "row_index out of range");
    TORCH_CHECK(lp[t] >= 0 && lp[t] <= width, "lengths must be in 0..L");
    const int64_t* row = index + r * width;
    bool outside = false;  // one test per row, so that the loop vectorises (a negative slot wraps to a huge one)
    for (int64_t j = 0; j < lp[t]; ++j) outside |= static_cast<uint64_t>(row[j]) >= static_cast<uint64_t>(total_slots);
    TORCH_CHECK(!outside, "slot out of range");
  }
}

// Token t (a decode row, or one new token of a short prefill chunk) attends slots
// kv_index[row_index[t], 0 .. lengths[t] - 1] (row_index absent: row t). Returns (out [B, H, D] in q's dtype,
// lse [B, H] float32).
std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                            torch::Tensor kv_index, c10::optional<torch::Tensor> row_index,
                                            torch::Tensor lengths, double scale, int64_t num_kv_heads) {
  TORCH_CHECK(q.dim() == 3 && num_kv_heads > 0, "q must be [B, H, D] and num_kv_heads positive");
  const int64_t row_elems = num_kv_heads * (q.size(2) + (k_pool.scalar_type() == torch::kInt8 ? 4 : 0));
  TORCH_CHECK(k_pool.numel() % row_elems == 0, "KV pools must be [slots, kv_heads * head_dim]");
  check_decode_slots(kv_index, row_index, lengths, k_pool.numel() / row_elems);
  return decode_attention_unchecked(q, k_pool, v_pool, kv_index, row_index, lengths, scale, num_kv_heads);
}

std::vector<torch::Tensor> decode_attention_unchecked(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                                      torch::Tensor kv_index, c10::optional<torch::Tensor> row_index,
                                                      torch::Tensor lengths, double scale, int64_t num_kv_heads) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16),
              "q must be float32 or bfloat16 [B, H, D]");
  q = fastcpu::heads_side_by_side(q);
  const int64_t h = q.size(1), d = q.size(2);
  TORCH_CHECK(h % num_kv_heads == 0 && h / num_kv_heads <= kMaxGroup, "unsupported head grouping");
  TORCH_CHECK(d % 16 == 0 && d <= kMaxDim, "head dim must be a multiple of 16, at most 256");
  const int64_t row = d + (k_pool.scalar_type() == torch::kInt8 ? 4 : 0);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.numel() % (num_kv_heads * row) == 0,
              "KV pools must be contiguous [slots, kv_heads * head_dim] (head_dim + 4 int8 per head: int8 format)");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools differ in dtype");
  // the table's own shape and dtypes were checked with its slots (check_decode_slots, the callers' job)
  TORCH_CHECK(lengths.numel() == q.size(0), "lengths needs one entry per token");
  lengths = lengths.contiguous();
  const torch::Tensor rows = row_index.has_value() ? row_index->contiguous() : torch::Tensor();
  if (k_pool.scalar_type() == torch::kFloat32)
    return decode_attention_impl<float>(q, k_pool, v_pool, kv_index, rows, lengths, scale, num_kv_heads);
  if (k_pool.scalar_type() == torch::kInt8)
    return decode_attention_impl<int8_t>(q, k_pool, v_pool, kv_index, rows, lengths, scale, num_kv_heads);
  TORCH_CHECK(k_pool.scalar_type() == torch::kBFloat16, "KV pools must be float32, bfloat16 or int8");
  return decode_attention_impl<at::BFloat16>(q, k_pool, v_pool, kv_index, rows, lengths, scale, num_kv_heads);
}
