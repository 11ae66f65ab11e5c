// What the linear kernels need to run on AMX tiles (CPUs with amx_tile, amx_bf16 and amx_int8, where the compiler
// targets them: -march=native on such a host): the tile configuration and the process's permission to use them.
//
// Why tiles: one TDPBF16PS / TDPBSUD multiplies up to 16 rows by a 32 x 16 bf16 (or 64 x 16 int8) block of a
// weight, 16-32x the work of one AVX-512 dot product, so a batch of rows costs little more than one row: the
// weights are read as fast as at one row, and a prefill chunk's products stop being compute-bound. The packed
// layouts need no change: 16 consecutive k pairs (bf16) or 4-k groups (int8) of a 16-column slice of a panel are
// a B tile, rows of 64 bytes at the panel's stride.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define FASTCPU_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace fastcpu {

// ldtilecfg's 64-byte operand (palette 1): bytes per row and rows of each of the 16 tile registers.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig& tile(int t, int rows_, int bytes) {
    rows[t] = static_cast<uint8_t>(rows_);
    colsb[t] = static_cast<uint16_t>(bytes);
    return *this;
  }
};

// Linux gives a process the tiles' register state (8 KB more per thread in every context switch) only on request.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Rows per tile block for m activation rows (up to 16; all of them when they fit one block), and the rows the
// activations are zero-padded to so that every block is a whole tile (its padding rows computed and dropped).
inline int64_t amx_block_rows(int64_t m) { return m < 16 ? m : 16; }
inline int64_t amx_padded_rows(int64_t m) { return m <= 16 ? m : (m + 15) / 16 * 16; }

// A thread's tiles configured for the duration of a scope, released (their state back to init) at its end.
class TileScope {
 public:
  explicit TileScope(const TileConfig& config) { _tile_loadconfig(&config); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// What one tile product multiplies: bf16 pairs into fp32 (TDPBF16PS), or signed by unsigned bytes into int32
// (TDPBSUD: activations by the offset weights of linear_int8).
enum class TileDot { kBf16, kInt8 };

// The tile kernels' step, with their shared tile numbering (0-3 results, 4 the A tile, 6 and 7 B tiles): tiles 0-3
// += the A tile (rows `lda` bytes apart from `a`) x the four 16-column slices of a 64-column block (slice s at
// `b` + 64 s bytes, its rows `ldb` bytes apart), loaded into tiles 6 and 7 in turn.
template <TileDot kDot>
inline void products_x4(const void* a, int64_t lda, const void* b, int64_t ldb) {
  const char* slices = static_cast<const char*>(b);
  // GCC's tile intrinsics take their tile numbers as literals, so each product is spelled out for both kinds
  const auto product = [](auto dot_bf16, auto dot_int8) {
    if constexpr (kDot == TileDot::kBf16) dot_bf16(); else dot_int8();
  };
  _tile_loadd(4, a, lda);
  _tile_loadd(6, slices, ldb);
  product([] { _tile_dpbf16ps(0, 4, 6); }, [] { _tile_dpbsud(0, 4, 6); });
  _tile_loadd(7, slices + 64, ldb);
  product([] { _tile_dpbf16ps(1, 4, 7); }, [] { _tile_dpbsud(1, 4, 7); });
  _tile_loadd(6, slices + 128, ldb);
  product([] { _tile_dpbf16ps(2, 4, 6); }, [] { _tile_dpbsud(2, 4, 6); });
  _tile_loadd(7, slices + 192, ldb);
  product([] { _tile_dpbf16ps(3, 4, 7); }, [] { _tile_dpbsud(3, 4, 7); });
}

inline void zero_x4() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Tiles 0-3 (fp32 or int32, 16 columns each) side by side from `out`, rows `ldo` values apart.
template <typename T>
inline void store_x4(T* out, int64_t ldo) {
  static_assert(sizeof(T) == 4, "tile results are 4-byte values");
  _tile_stored(0, out, ldo * 4);
  _tile_stored(1, out + 16, ldo * 4);
  _tile_stored(2, out + 32, ldo * 4);
  _tile_stored(3, out + 48, ldo * 4);
}

}  // namespace fastcpu
#endif
