// The KV prefix as extend_attention reads it (fastcpu_extend.cpp), and the packing that writes it
// (fastcpu_pack.cpp). K of one KV head as tiles of 16 keys: [tiles][D/2][16 keys][2] — for each pair of dims, the 16
// keys' two values side by side (vdpbf16ps's operand, and on AMX a B tile of 16 dim pairs). V as pairs of keys:
// [S/2][D][2] — for each pair of keys, every dim's two values side by side. Both take 16 * D values per tile; keys
// past S are zero. A layer's pack of all KV heads is [Hkv][padded][D] for K and for V (padded: S rounded up to 32).
#pragma once

#include <torch/extension.h>

#include "fastcpu_vec.h"

#include <cstdint>

#ifdef FASTCPU_BF16_DOT

namespace fastcpu::extend {

constexpr int64_t kKeys = 16;  // keys per K tile: one vector of fp32 scores
constexpr int64_t kMaxDim = 128;

// Keys of a pack of S keys (the `padded` above): S rounded up to 32, because the softmax writes its probabilities as
// bf16 pairs 32 keys at a time. extend_attention checks a kept pack against it, so the two sides share this one rule.
inline int64_t padded_keys(int64_t s) { return (s + 31) / 32 * 32; }

// One layer's K and V pools as the packing reads them: rows of bf16 values, or of the int8 format (head_dim int8
// values, then the row's float32 scale: radix/kv_int8.py), converted to bf16 as they are packed.
struct PoolRows {
  const char* k;
  const char* v;
  int64_t slot_bytes;  // a slot's row over all KV heads
  int64_t head_bytes;  // one head's part of it
  bool int8;
};

// The checks both extend_attention and pack_prefix make on the pools and the slot row; the pools as pack_heads
// reads them.
PoolRows check_pools(const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& kv_index,
                     int64_t hkv, int64_t d);

// Every tile of every KV head of the slots [S] into kp and vp, each [Hkv][padded][D], on the threads.
void pack_heads(const PoolRows& pool, int64_t hkv, int64_t d, const int64_t* slots, int64_t s, int64_t padded,
                uint16_t* kp, uint16_t* vp);

}  // namespace fastcpu::extend

#endif  // FASTCPU_BF16_DOT
