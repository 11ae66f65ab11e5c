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
// thread's share of it, split the way the linear kernels split panels between threads (fastcpu::parallel_panels:
// PanelSplit, PanelWeight::share), and hands out one line per tick().
//
// The same idea inside a linear kernel: PanelFetch (below) has the passes over one panel that compute from cache
// ask for the thread's next panel.
#pragma once

#include <torch/extension.h>

#include "fastcpu_team.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace fastcpu {

// A packed linear layer's weight as the fetches see it: [panels, ...] contiguous (PackedLinear's data).
inline PanelWeight panel_weight(const torch::Tensor& packed) {
  const int64_t panels = packed.size(0);
  return {static_cast<const char*>(packed.data_ptr()), panels, static_cast<int64_t>(packed.nbytes()) / panels};
}

struct FetchPlan {
  static constexpr int kMaxWeights = 4;
  PanelWeight weights[kMaxWeights];
  int count = 0;

  void add(const torch::Tensor& packed) {
    if (count == kMaxWeights || packed.numel() == 0) return;
    weights[count++] = panel_weight(packed);
  }
};

class FetchCursor {
 public:
  FetchCursor() = default;  // fetches nothing

  // Thread `thread` of `threads`: for each weight in turn, the panels that thread multiplies.
  FetchCursor(const FetchPlan* plan, int64_t thread, int64_t threads) {
    if (plan == nullptr || threads <= 0) return;
    const PanelSplit split = panel_split();
    for (int i = 0; i < plan->count; ++i) {
      const auto [begin, end] = plan->weights[i].share(thread, threads, split);
      if (begin < end) spans_[spans_count_++] = {begin, end};
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

// What a linear kernel's passes over one weight panel ask for ahead of their loads, per k-group of 4 cache lines.
// The first pass over a panel reads it from memory: it asks for the panel itself, a few k-groups ahead, all 4
// lines of each. The later passes (a 6-row tile's other half of the columns, a decode batch's remaining rows)
// read the panel from cache and used to leave the memory idle: each asks for a quarter of the panel this thread
// multiplies next, one line per k-group it reads, so that the next panel's first pass finds part of it in cache.
// At batch 8 a step's int8 linears took about the time of reading their weights plus that of multiplying them.
// Both ask for L2 (prefetcht2), not L1: the pass's own loads move a line on into L1 when they reach it. The 120
// int8 linears of 30 layers from memory, both hints alternated in one process (bench_kernel_ab.py, 16 rounds, three
// runs on the Zen 4 VM): 0.85-0.93x the time at 1 row, 0.92x at 8, 0.99x at 169; the batch-8 stack 0.94-0.95x.
// L2 for the panel's own lines but L1 for the next panel's quarters took 1.22x the time of both in L2 at 8 rows.
// Where a panel takes more than one pass (4+ rows), the first pass also asks for the next panel's first quarter
// (FirstPassFetch) and each later pass for the following one: at 8 rows three of the next panel's quarters are
// asked for while this one is multiplied, against two when only the later passes asked. The 120 linears from
// memory, alternated (bench_kernel_ab.py, 24 rounds, three runs): 0.948-0.957x the time at 8 rows, 0.97-1.00x at
// 169; the batch-8 int8 stacks, whose team fetches ahead between jobs anyway, 0.98-0.99x. A lone pass (1-3 rows)
// asks as before; a second stream tested inside every pass's loop cost 1-4% at 1 row.
struct PassFetch {
  const char* base = nullptr;  // null: nothing
  int lines = 0;  // lines asked for per k-group
  inline void at(int64_t group) const {
    for (int line = 0; line < lines; ++line) _mm_prefetch(base + (group * lines + line) * 64, _MM_HINT_T2);
  }
};

// The first of several passes over a panel: its own lines ahead, and one line per k-group of the next panel's
// first quarter (a type of its own, so that a lone pass's loop carries no test for the second stream).
struct FirstPassFetch {
  PassFetch own;
  const char* next;
  inline void at(int64_t group) const {
    own.at(group);
    _mm_prefetch(next + group * 64, _MM_HINT_T2);
  }
};

class PanelFetch {
 public:
  // ahead: the panel's own weights a few groups ahead of its first pass (null: its first pass was earlier);
  // next: the panel read next by this thread (null: none); groups: k-groups per panel (4 lines each);
  // passes: how many passes the kernel makes over the panel.
  PanelFetch(const void* ahead, const void* next, int64_t groups, int passes)
      : ahead_(static_cast<const char*>(ahead)), next_(static_cast<const char*>(next)), groups_(groups),
        several_(passes > 1) {}

  // Whether the next pass is the first of several over a panel read from memory, with a next panel to ask for
  // (then first_pass(), else next_pass()).
  bool first_of_several() const { return pass_ == 0 && ahead_ != nullptr && several_ && next_ != nullptr; }
  FirstPassFetch first_pass() {
    ++pass_;
    return {{ahead_, 4}, next_};
  }

  // What the next pass over the panel asks for.
  PassFetch next_pass() {
    const int pass = pass_++;
    if (pass == 0 && ahead_ != nullptr) return {ahead_, 4};
    // pass p asks for quarter p of the next panel (a first pass from memory asks for quarter 0 in first_pass)
    if (next_ == nullptr || pass >= 4) return {};
    return {next_ + pass * groups_ * 64, 1};
  }

 private:
  const char* ahead_;
  const char* next_;
  int64_t groups_;
  bool several_;  // more than one pass over the panel
  int pass_ = 0;
};

}  // namespace fastcpu
