// The fastcpu kernels as C++ functions (each defined in one fastcpu*.cpp, bound to Python in fastcpu.cpp), so the
// decode stack (fastcpu_decoder.cpp) calls them directly instead of through Python.
#pragma once

#include <torch/extension.h>

#include "fastcpu_fetch.h"

#include <vector>

// fastcpu.cpp
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> scale,
                            c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> out);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed);

// fastcpu_attention.cpp
std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                            torch::Tensor kv_index, c10::optional<torch::Tensor> row_index,
                                            torch::Tensor lengths, double scale, int64_t num_kv_heads);
// the same without check_decode_slots, which the caller must have run on the same table (once for many calls)
std::vector<torch::Tensor> decode_attention_unchecked(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                                      torch::Tensor kv_index, c10::optional<torch::Tensor> row_index,
                                                      torch::Tensor lengths, double scale, int64_t num_kv_heads);
void check_decode_slots(const torch::Tensor& kv_index, const c10::optional<torch::Tensor>& row_index,
                        const torch::Tensor& lengths, int64_t total_slots);

// fastcpu_int8.cpp
namespace fastcpu {
// linear_int8 splits its work by whole panels up to this many rows, past it by (panel, rows) items.
constexpr int64_t kInt8ChunkRows = 48;
}  // namespace fastcpu
bool int8_vnni();  // the int8 KV pool's attention dot products (AVX512-VNNI)
bool int8_dot();   // linear_int8 (AVX512-VNNI or AVX2)
bool int8_split(int64_t k);  // whether linear_int8 takes rows of k values as two-part activations (AMX)
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor scale,
                          c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> out, int64_t block);

// fastcpu_bf16.cpp
bool bf16_dot();
bool amx_tiles();
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> out);

// fastcpu_extend.cpp
std::vector<torch::Tensor> extend_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                            torch::Tensor kv_index, torch::Tensor lengths, double scale,
                                            int64_t num_kv_heads, c10::optional<std::vector<torch::Tensor>> packed);
// the same, its threads asking for `fetch`'s weights between their dot products (fastcpu_fetch.h)
std::vector<torch::Tensor> extend_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                            torch::Tensor kv_index, torch::Tensor lengths, double scale,
                                            int64_t num_kv_heads, c10::optional<std::vector<torch::Tensor>> packed,
                                            const fastcpu::FetchPlan* fetch);
void merge_attention(torch::Tensor out, torch::Tensor lse, torch::Tensor o_shared, torch::Tensor lse_shared);

// fastcpu_kv.cpp
void store_kv(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots, torch::Tensor k, torch::Tensor v);

// fastcpu_pack.cpp
std::vector<torch::Tensor> pack_prefix(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor kv_index,
                                       int64_t num_kv_heads, int64_t head_dim);

// fastcpu_decoder.cpp: binds DecodeStack into the module.
void bind_decoder(pybind11::module& m);
