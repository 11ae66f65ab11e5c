// What the decode attention kernels share (fastcpu_attention.cpp, fastcpu_attend_dot.h): tile and range sizes,
// the prefetch of KV rows, the int8 rows' scale, and the softmax and output steps of the dot-product kernels.
#pragma once

#include "fastcpu_vec.h"

namespace fastcpu::attend {

constexpr int kTile = 16;  // KV positions scored at once
constexpr int kMaxGroup = 16;  // query heads per KV head handled by the vector path
constexpr int kMaxDim = 256;
// Query heads attended in one pass over a KV row (several tokens of one request): 9 (three tokens of a 3-group
// model) measured fastest for a 5-token draft at 1.5k context — 7.3 ms over 30 layers against 11.6 one token
// at a time; 15 at once spills the accumulators and is no faster.
constexpr int kSegmentHeads = 9;
// Query heads one call may attend: a segment's (at most kMaxGroup), or those of several rows whose slots agree over
// the call's range (share_ranges, fastcpu_attention.cpp): a batch of 8 rows of a 3-group model in one AVX2 call.
constexpr int kMaxCallHeads = 24;
constexpr int64_t kRange = 256;  // KV positions of one work item (a row's ranges start at 0, kRange, ...)
constexpr int64_t kPrefetch = 2 * kTile;  // how far ahead the K and V rows are fetched (prefetch_row)

// Software prefetch of one head's row of K or V, kPrefetch positions ahead: the rows of a request are scattered
// over the pool (one slot each), so the hardware's stream prefetchers cannot see the next one coming. Two tiles
// ahead, not one: a tile takes less time to attend than a read from memory takes to arrive. Over 1k positions
// from memory, 30 layers, the two builds alternated in one process (bench_kernel_ab.py, five runs): batch 1 took
// 0.89-1.00x the time, batch 8 0.91-0.99x, where unchanged kernels varied by +-10%; six tiles were slower.
// An int8 row (d values and a 4-byte scale) starts anywhere in a cache line: its first and last bytes are fetched.
// bf16 and fp32 rows are asked for into L2 (prefetcht2), int8 rows into L1: 30 layers from memory, both hints
// alternated in one process (bench_kernel_ab.py, Zen 4 VM), L2 took 0.90-0.92x the time at batch 8 and 0.94-1.01x at
// batch 1 over a bf16 pool, 0.70-0.78x over fp32, and over int8 1.03-1.04x at batch 1, 0.95-1.00x at batch 8.
template <typename KV>
inline void prefetch_row(const KV* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  const int64_t bytes = d * static_cast<int64_t>(sizeof(KV)) + (kInt8 ? 4 : 0);
  constexpr auto kHint = kInt8 ? _MM_HINT_T0 : _MM_HINT_T2;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, kHint);
  if constexpr (kInt8) _mm_prefetch(p + bytes - 1, kHint);
}

// How much of a slot's row prefetch_row asks for in a work item's pass over one KV head (head_off: the head's
// offset in the slot's row, slot_stride: the whole row). A work item attends its range with the KV heads in turn,
// and a slot's heads sit side by side in the pool, so the later heads find their rows in cache: the first head's
// pass was the one waiting on the memory, and it had asked for its own part only. It now asks for the whole row,
// the later heads for their own part again (by then in L2). 30 layers from memory, 8 rows of 1k positions, against
// fetching the own part only: 0.77-0.84x the time over a bf16 pool, 0.90x over fp32, 0.96x over int8; one row
// 0.90-0.97x (bf16); one layer's rows already in cache 1.04-1.07x (three times the first pass's prefetches).
template <typename KV>
inline int64_t prefetch_length(int64_t head_off, int64_t slot_stride, int64_t d) {
  if (head_off != 0) return d;
  return std::is_same_v<KV, int8_t> ? slot_stride - 4 : slot_stride;  // prefetch_row adds an int8 row's scale
}

// The scale of an int8 KV row (the float32 after its d values: radix/kv_int8.py); 1 for float rows, never applied.
template <typename KV>
inline float row_scale(const KV* row, int64_t d) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    float scale;
    std::memcpy(&scale, row + d, sizeof(scale));
    return scale;
  } else {
    (void)row;
    (void)d;
    return 1.f;
  }
}

// The factor that rescales a head's running sums when its running max moves from m to new_m: exp(m - new_m),
// 0 on the first tile (m = -inf). Once the max has settled (most tiles of a long row) it is exactly 1, and the
// scalar exp and the multiplications by it are skipped: multiplying by 1 changes no bit.
inline float rescale(float m, float new_m) { return new_m == m ? 1.f : std::exp(m - new_m); }

#ifdef __AVX512F__
// Two accumulators of pairs of positions (vdpbf16ps, vpdpwssd over value rows interleaved word by word with
// unpacklo/hi_epi16, within 128-bit lanes) written back as dims in order: dim c*32 + k, k in 128-bit lane
// L = k / 8 and word w = k % 8, is the unpacklo accumulator's lane 4L + w for w < 4, the unpackhi one's
// 4L + w - 4 otherwise.
inline void store_interleaved(float* out, __m512 acc_lo, __m512 acc_hi) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(acc_lo, lo, acc_hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(acc_lo, hi, acc_hi));
}
#endif

}  // namespace fastcpu::attend
