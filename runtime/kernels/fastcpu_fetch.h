// Weights a compute-bound kernel asks the memory for while it runs, so that the memory-bound kernels after it
// find them in cache.
//
// Why: a decode step alternates between phases that wait on the memory (the linear layers stream their
// weights: ~7 MB per layer in bf16) and phases that leave it idle (a cascade group's attention over its shared
// prefix computes from a kept pack of ~0.8 MB per layer: dot products, not reads). The two added up. While the
// attention of layer i runs, its threads now also ask, a cache line at a time between their dot products, for
// the weights of the linears that follow it (layer i's o, gate/up and down projections), each thread for the
// panels it will multiply itself, in the order they will be read. Nothing here changes a result: a prefetch
// only moves data closer.
//
// FetchPlan lists the weights (packed linear layers: [panels, ...] rows of equal bytes); FetchCursor is one
// thread's share of it, split the way the linear kernels split panels between threads (at::parallel_for over
// panels: contiguous chunks of ceil(panels / threads)), and hands out one line per tick().
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace fastcpu {

struct FetchPlan {
  static constexpr int kMaxWeights = 4;
  struct Weight {
    const char* data;
    int64_t panels, panel_bytes;
  };
  Weight weights[kMaxWeights];
  int count = 0;

  // A packed linear layer's weight: [panels, ...] contiguous (PackedLinear's data).
  void add(const torch::Tensor& packed) {
    if (count == kMaxWeights || packed.numel() == 0) return;
    const int64_t panels = packed.size(0);
    weights[count++] = {static_cast<const char*>(packed.data_ptr()), panels,
                        static_cast<int64_t>(packed.nbytes()) / panels};
  }
};

class FetchCursor {
 public:
  FetchCursor() = default;  // fetches nothing

  // Thread `thread` of `threads`: for each weight in turn, the panels that thread multiplies.
  FetchCursor(const FetchPlan* plan, int64_t thread, int64_t threads) {
    if (plan == nullptr || threads <= 0) return;
    for (int i = 0; i < plan->count; ++i) {
      const FetchPlan::Weight& w = plan->weights[i];
      const int64_t chunk = (w.panels + threads - 1) / threads;
      const int64_t p0 = std::min(w.panels, thread * chunk), p1 = std::min(w.panels, p0 + chunk);
      if (p0 < p1) spans_[spans_count_++] = {w.data + p0 * w.panel_bytes, w.data + p1 * w.panel_bytes};
    }
  }

  // One more cache line of the share (nothing once it is all asked for).
  inline void tick() {
    if (at_ >= end_) {
      if (next_ == spans_count_) return;
      at_ = spans_[next_].begin;
      end_ = spans_[next_].end;
      ++next_;
    }
    _mm_prefetch(at_, _MM_HINT_T0);
    at_ += 64;
  }

 private:
  struct Span {
    const char* begin;
    const char* end;
  };
  Span spans_[FetchPlan::kMaxWeights] = {};
  int spans_count_ = 0, next_ = 0;
  const char* at_ = nullptr;
  const char* end_ = nullptr;
};

}  // namespace fastcpu
