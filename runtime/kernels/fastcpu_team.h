// Team: the threads of one OpenMP parallel region kept for a whole decode stack, instead of one region per kernel,
// and fastcpu::parallel_for, which every fastcpu kernel splits its work with.
//
// Why: a decode step runs ~180 short parallel regions (the linears, attention, the small ops at a few rows), and
// between them the calling thread does the serial work (quantising a few activation rows, allocating outputs,
// views) while the other threads spin in libgomp. In those gaps the memory sits idle, and the next linear then
// streams its weights from scratch: at batch 1 a step took about its weights' read time plus its in-cache time,
// the two added rather than overlapped. Inside a Team the other threads spend the gaps asking the memory for
// their own share of the linears that come next (prefetcht2 into their own core's L2; another core's fetches do
// not become hits for this one, measured), and a job is handed over through one atomic counter.
//
// Work is split as at::parallel_for splits it (the same number of threads for the same range and grain, the same
// contiguous chunk per thread id, at::get_thread_num() set to it), except a linear layer's panels in a team that
// fetches ahead (PanelSplit): the leader takes fewer of them. A split decides which thread computes an element,
// never how: the results are the same bits either way.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>

#include <immintrin.h>
#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <exception>
#include <utility>
#include <vector>

namespace fastcpu {

// Which of a linear layer's panels each thread multiplies: a contiguous run each.
//
// Even (everywhere outside a team, and in a team that does not fetch ahead): at::parallel_for's split, runs of
// ceil(panels / threads), thread 0 first. Light leader (a team that fetches ahead): the other threads spend the
// gaps between jobs fetching their next shares into their own L2 (Team::serve), while the leader spends them on
// the serial work between kernels, so the leader's panels come from memory and took it ~1.4x as long per panel
// at batch 8 (perf samples). It therefore takes the last ~0.9/(0.9 + others) of the panels and finishes with
// them: 4 of a 576-column layer's 9 panels and 22 of gate/up's 48 with two threads. Weights of 0.65, 0.8, 0.9 and
// 1.0 (the leader taking the last run) against the even split in one process (bench_kernel_ab.py, decode stacks
// at batch 8, int8): 1.00, 0.96, 0.95-0.96 and 0.98 of the time.
struct PanelSplit {
  static constexpr int64_t kLeaderPercent = 90;  // the leader's share against each other thread's
  bool light_leader = false;

  // Thread `thread` of `threads`' panels: [first, second).
  std::pair<int64_t, int64_t> range(int64_t panels, int64_t threads, int64_t thread) const {
    if (!light_leader || threads <= 1) {
      const int64_t chunk = (panels + threads - 1) / threads;
      const int64_t p0 = std::min(panels, thread * chunk);
      return {p0, std::min(panels, p0 + chunk)};
    }
    // at least one panel each while there are enough (two panels: one each, not both on the other thread)
    const int64_t lead = std::max<int64_t>(panels >= threads ? 1 : 0,
                                           panels * kLeaderPercent / (kLeaderPercent + 100 * (threads - 1)));
    const int64_t rest = panels - lead, chunk = (rest + threads - 2) / (threads - 1);
    if (thread == 0) return {rest, panels};
    const int64_t p0 = std::min(rest, (thread - 1) * chunk);
    return {p0, std::min(rest, p0 + chunk)};
  }
};

// A weight the team's threads will read, packed as the linear kernels read it: `panels` rows of `panel_bytes`.
struct PanelWeight {
  const char* data;
  int64_t panels, panel_bytes;

  // The bytes thread `thread` of `threads` multiplies under `split`: [first, second).
  std::pair<const char*, const char*> share(int64_t thread, int64_t threads, PanelSplit split) const {
    const auto [p0, p1] = split.range(panels, threads, thread);
    return {data + p0 * panel_bytes, data + p1 * panel_bytes};
  }
};

// One thread's share of a list of weights, walked a cache line at a time, at most `limit` bytes past the start
// of the share of weight `from` (which the leader moves on as the work reaches it).
class AheadCursor {
 public:
  AheadCursor(const std::vector<PanelWeight>* weights, int64_t thread, int64_t threads) {
    if (weights == nullptr) return;
    begin_.reserve(weights->size());
    end_.reserve(weights->size());
    before_.assign(weights->size() + 1, 0);
    for (size_t i = 0; i < weights->size(); ++i) {
      const auto [begin, end] = (*weights)[i].share(thread, threads, PanelSplit{true});
      begin_.push_back(begin);
      end_.push_back(end);
      before_[i + 1] = before_[i] + (end - begin);
    }
  }

  // Asks for up to `lines` more lines; false when there is nothing left within the limit.
  bool fetch(int64_t from, int64_t limit, int lines) {
    const int64_t n = static_cast<int64_t>(begin_.size());
    if (from >= n) return false;
    if (at_weight_ < from) {
      at_weight_ = from;
      at_ = begin_[from];
    }
    for (int i = 0; i < lines; ++i) {
      while (at_weight_ < n && at_ >= end_[at_weight_]) {
        if (++at_weight_ < n) at_ = begin_[at_weight_];
      }
      if (at_weight_ >= n) return false;
      if (before_[at_weight_] + (at_ - begin_[at_weight_]) - before_[from] >= limit) return false;
      _mm_prefetch(at_, _MM_HINT_T2);
      at_ += 64;
    }
    return true;
  }

 private:
  std::vector<const char*> begin_, end_;
  std::vector<int64_t> before_;  // bytes of the shares before weight i
  int64_t at_weight_ = -1;
  const char* at_ = nullptr;
};

class Team {
 public:
  // How far ahead of the work an idle thread fetches its share, and how many lines between two looks for a job.
  // A core's L2 holds 1-2 MB. In one process against the same build with 512 KB (bench_kernel_ab.py, the decode
  // stacks at batch 1 and 8, 16 rounds): 0.97-1.01x; 8 lines against 2 per look: 0.98-1.01x.
  static constexpr int64_t kAheadBytes = 1024 * 1024;
  static constexpr int kAheadLines = 4;
  // How long a thread with nothing to fetch waits, in time-stamp counter ticks (~50-100 us at the 2-4 GHz such
  // counters run at), before it gives its core away: an idle thread then sleeps until the next job, a waiting
  // leader yields. On a host with more runnable threads than cores (several servers, or test processes side by
  // side) a team that only spun kept the cores from the threads it waited for: two test files with servers took
  // 2.5x their time. Within a step the waits between jobs are far shorter. A count of pauses would not do: a
  // pause takes a few cycles on some CPUs and ~140 on others.
  static constexpr uint64_t kIdleTicks = 200000;

  // lead(team) on the calling thread while the region's other threads serve its parallel_for calls; returns
  // when lead does (an exception from lead or from a job is rethrown here, after the region).
  template <typename Lead>
  static void run(const Lead& lead) {
    Team team;
    std::exception_ptr failure;
#pragma omp parallel
    {
      const int tid = omp_get_thread_num();
      if (tid == 0) {
        team.size_ = omp_get_num_threads();
        Member member(&team, 0);
        team.started_.store(true, std::memory_order_release);
        try {
          lead(team);
        } catch (...) {
          failure = std::current_exception();
        }
        team.post({nullptr, nullptr, 0, 0, 0, false});  // the stop job
      } else {
        for (const uint64_t since = __rdtsc(); !team.started_.load(std::memory_order_acquire);) relax(since);
        Member member(&team, tid);
        team.serve(tid);
      }
    }
    if (failure) std::rethrow_exception(failure);
  }

  // The team the calling thread belongs to (null outside one) and its place in it.
  static Team* current() { return slot().team; }
  static int thread() { return slot().tid; }

  int size() const { return size_; }

  // fn(begin, end) over [begin, end) on the team's threads, split as at::parallel_for splits it. Only the leader
  // hands out work; from inside a job it runs on the calling thread (as at::parallel_for does inside a region).
  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    split(begin, end, grain, f, false);
  }

  // fn(p0, p1) over the panels [0, panels) of a linear layer, split by panel_split(); otherwise as parallel_for.
  template <typename F>
  void parallel_panels(int64_t panels, const F& f) {
    split(0, panels, 1, f, panel_split().light_leader);
  }

  // How this team splits a linear layer's panels: a light leader while it fetches ahead.
  PanelSplit panel_split() const { return {plan_.load(std::memory_order_relaxed) != nullptr}; }

  // The weights the leader's work will read next, in order (null: none); then, as it goes, the first of them
  // not yet started (the idle threads fetch from there).
  void fetch_ahead(const std::vector<PanelWeight>* weights) {
    plan_.store(weights, std::memory_order_relaxed);
    from_.store(0, std::memory_order_relaxed);
    ahead_ = AheadCursor(weights, 0, size_);
  }
  void ahead_from(int64_t index) { from_.store(index, std::memory_order_relaxed); }

 private:
  using Fn = void (*)(const void*, int64_t, int64_t);

  // A job: fn(ctx, b, e) over [begin, end); thread t's part is at::parallel_for's (runs of `chunk`), or for a
  // linear's panels the light leader's split.
  struct Job {
    Fn fn;
    const void* ctx;
    int64_t begin, end, chunk;
    bool panels;
  };

  // parallel_for's and parallel_panels' way: inline where at::parallel_for would run inline, else a job whose
  // parts are at::parallel_for's chunks or (light_panels) the light leader's panel split.
  template <typename F>
  void split(int64_t begin, int64_t end, int64_t grain, const F& f, bool light_panels) {
    if (begin >= end) return;
    const int64_t numiter = end - begin;
    if (thread() != 0 || in_job_ || size_ == 1 || numiter <= grain || numiter == 1) {
      at::internal::ThreadIdGuard tid_guard(0);  // as at::parallel_for runs it inline
      c10::ParallelGuard guard(true);
      f(begin, end);
      return;
    }
    int64_t used = size_;
    if (grain > 0) used = std::min<int64_t>(used, (numiter + grain - 1) / grain);
    lead({&call<F>, &f, begin, end, (numiter + used - 1) / used, light_panels});
  }

  // Posts `job` (the leader's part run here) and waits for the other threads' parts.
  void lead(const Job& job) {
    post(job);
    std::exception_ptr own;
    in_job_ = true;
    try {
      run_part(job, 0);
    } catch (...) {
      own = std::current_exception();
    }
    in_job_ = false;
    // the leader's own share of what comes next, while the others finish theirs
    for (const uint64_t since = __rdtsc(); pending_.load(std::memory_order_acquire) != 0;)
      if (!ahead_.fetch(from_.load(std::memory_order_relaxed), kAheadBytes, kAheadLines)) relax(since);
    if (!own) std::swap(own, job_failure_);
    job_failure_ = nullptr;
    failed_.clear();
    if (own) std::rethrow_exception(own);
  }

  struct Slot {
    Team* team = nullptr;
    int tid = 0;
  };
  static Slot& slot() {
    static thread_local Slot s;
    return s;
  }
  struct Member {  // the calling thread's place in a team, for the region's lifetime
    Member(Team* team, int tid) { slot() = {team, tid}; }
    ~Member() { slot() = {}; }
  };

  template <typename F>
  static void call(const void* f, int64_t b, int64_t e) {
    (*static_cast<const F*>(f))(b, e);
  }

  // One wait with nothing to do, waiting since `since`: a pause, or past kIdleTicks the rest of this time slice to
  // whoever wants it.
  static void relax(uint64_t since) {
    if (__rdtsc() - since < kIdleTicks) {
      _mm_pause();
    } else {
      sched_yield();
    }
  }

  // Thread `tid`'s range of `job`: [first, second).
  std::pair<int64_t, int64_t> part(const Job& job, int tid) const {
    if (job.panels) {
      const auto [p0, p1] = PanelSplit{true}.range(job.end - job.begin, size_, tid);
      return {job.begin + p0, job.begin + p1};
    }
    const int64_t b = job.begin + tid * job.chunk;
    return {b, std::min(job.end, b + job.chunk)};
  }

  // Thread `tid`'s part of `job`.
  void run_part(const Job& job, int tid) const {
    const auto [b, e] = part(job, tid);
    if (b >= e) return;
    at::internal::ThreadIdGuard tid_guard(tid);
    c10::ParallelGuard guard(true);
    job.fn(job.ctx, b, e);
  }

  // Publishes a job (fn null: stop) to the other threads; the leader has waited for the last one's end.
  void post(const Job& job) {
    if (size_ == 1) return;
    job_ = job;
    pending_.store(size_ - 1, std::memory_order_relaxed);
    seq_.fetch_add(1, std::memory_order_seq_cst);
    // a thread that counted itself asleep before this job was posted is woken; one counting itself after sees it
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
  }

  long futex(int op, uint32_t value) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), op, value, nullptr, nullptr, 0);
  }

  // Sleeps until a job after `seen` is posted (at once if one is).
  void sleep_past(uint32_t seen) {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (seq_.load(std::memory_order_seq_cst) == seen) futex(FUTEX_WAIT_PRIVATE, seen);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  void serve(int tid) {
    AheadCursor ahead(nullptr, tid, size_);
    const std::vector<PanelWeight>* plan = nullptr;
    uint32_t seen = 0;
    uint64_t idle_since = 0;  // 0: busy (a job or fetching ahead)
    for (;;) {
      const uint32_t s = seq_.load(std::memory_order_acquire);
      if (s == seen) {
        const std::vector<PanelWeight>* p = plan_.load(std::memory_order_relaxed);
        if (p != plan) {
          plan = p;
          ahead = AheadCursor(p, tid, size_);
        }
        if (ahead.fetch(from_.load(std::memory_order_relaxed), kAheadBytes, kAheadLines)) {
          idle_since = 0;
        } else if (idle_since == 0) {
          idle_since = __rdtsc();
        } else if (__rdtsc() - idle_since < kIdleTicks) {
          _mm_pause();
        } else {
          sleep_past(seen);
          idle_since = 0;
        }
        continue;
      }
      seen = s;
      idle_since = 0;
      const Job job = job_;
      if (job.fn == nullptr) {
        pending_.fetch_sub(1, std::memory_order_release);
        return;
      }
      try {
        run_part(job, tid);
      } catch (...) {
        if (!failed_.test_and_set()) job_failure_ = std::current_exception();  // the first one is reported
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  int size_ = 1;
  Job job_{};
  std::exception_ptr job_failure_;
  std::atomic_flag failed_ = ATOMIC_FLAG_INIT;
  bool in_job_ = false;  // the leader runs its chunk of a job (a nested parallel_for stays on it)
  // read by the idle threads while the leader changes them (a prefetch plan: a stale read costs nothing)
  std::atomic<const std::vector<PanelWeight>*> plan_{nullptr};
  AheadCursor ahead_{nullptr, 0, 1};
  alignas(64) std::atomic<bool> started_{false};
  alignas(64) std::atomic<uint32_t> seq_{0};  // jobs posted (a futex word: 32 bits; equality is all it is read for)
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word is the atomic itself");
  alignas(64) std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<int64_t> from_{0};
};

// fn(begin, end) over [begin, end): on the calling thread's team when it leads one, else at::parallel_for.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (Team* team = Team::current()) {
    team->parallel_for(begin, end, grain, f);
  } else {
    at::parallel_for(begin, end, grain, f);
  }
}

// fn(p0, p1) over a linear layer's panels [0, panels): split by panel_split() on the calling thread's team when
// it leads one, else at::parallel_for's.
template <typename F>
inline void parallel_panels(int64_t panels, const F& f) {
  if (Team* team = Team::current()) {
    team->parallel_panels(panels, f);
  } else {
    at::parallel_for(0, panels, 1, f);
  }
}

// How the linear kernels running now split their panels (FetchCursor fetches the shares they will read).
inline PanelSplit panel_split() {
  const Team* team = Team::current();
  return team != nullptr ? team->panel_split() : PanelSplit{};
}

// The threads fastcpu::parallel_for splits over.
inline int64_t num_threads() {
  const Team* team = Team::current();
  return team != nullptr ? team->size() : at::get_num_threads();
}

}  // namespace fastcpu
