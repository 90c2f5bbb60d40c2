// bfloat16 building blocks of the matrix-unit kernels (bsmm_cpu_bf16.cc, bsconv_cpu_bf16.cc):
// narrowing float32 rows to bf16, the VNNI packing of weight blocks, and the AMX tile
// configuration and product steps.
//
// Included only by files compiled with the AMX and AVX512-BF16 flags (JBS_CPU_BF16_KERNELS;
// see CMakeLists.txt). Everything here has internal linkage (an unnamed namespace): no
// copy compiled with these flags may be merged into code that runs on other CPUs.
#ifndef JAX_BLOCKSPARSE_CUDA_CPU_BF16_TILES_H_
#define JAX_BLOCKSPARSE_CUDA_CPU_BF16_TILES_H_

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "bsmm_block_sizes.h"
#include "cpu/bsmm_cpu.h"  // bf16::kMinBlock
#include "cpu/cpu_simd.h"  // FloatToBf16, ReleaseLargeBuffers (needs JBS_CPU_ISA: bf16)

namespace jbs {
namespace cpu {
namespace bf16 {
namespace {

// The entry points' frame: run(bs) (bs a std::integral_constant of the block size) for
// blocks of kMinBlock or more, false for smaller ones; then the calling thread's large
// buffers are freed.
template <typename Run>
bool ForTileBlockSize(int bs, Run run) {
  const bool ok = DispatchBlockSize(bs, [&](auto b) {
    if constexpr (decltype(b)::value < kMinBlock) {
      return false;
    } else {
      return run(b);
    }
  });
  ReleaseLargeBuffers();
  return ok;
}

// ---------------------------------------------------------------------------------
// Narrowing float32 to bf16, 16 at a time, like FloatToBf16 (round to nearest even;
// quiet NaN), which VCVTNEPS2BF16 is not for denormal inputs.
// ---------------------------------------------------------------------------------

inline __m256i NarrowBf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// dst[i] = bf16(src[i]) for i < count.
void NarrowRow(const float* src, uint16_t* dst, int64_t count) {
  const int64_t whole = count - count % 16;
  for (int64_t i = 0; i < whole; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), NarrowBf16x16(_mm512_loadu_ps(src + i)));
  }
  for (int64_t i = whole; i < count; ++i) dst[i] = FloatToBf16(src[i]);
}

// ---------------------------------------------------------------------------------
// Packing
// ---------------------------------------------------------------------------------

// A row of zeros standing in for the rows past the end (padding to a multiple of 32).
alignas(64) const uint16_t kZeros[128] = {};

// Interleaves rows r0 and r1 (count bf16 each) into dst[2 * count]: (r0[j], r1[j]) pairs.
void InterleaveRows(const uint16_t* r0, const uint16_t* r1, uint16_t* dst, int64_t count) {
  int64_t j = 0;
  if (count >= 16) {
    // Lanes 0..15 of the index take r0, 16..31 take r1: (0, 16, 1, 17, ...).
    alignas(64) static const uint16_t kIndex[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i index = _mm512_load_si512(kIndex);
    for (; j + 16 <= count; j += 16) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + j));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + j));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(dst + 2 * j, _mm512_permutexvar_epi16(index, both));
    }
  }
  for (; j < count; ++j) {
    dst[2 * j] = r0[j];
    dst[2 * j + 1] = r1 ? r1[j] : 0;
  }
}

// dst[j][i] = src[i][j] for a 16 x 16 block of 32-bit words (row strides in words):
// unpacks of 32- and 64-bit words within 128-bit lanes, then two rounds of lane shuffles.
void Transpose16x16(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {  // lane L of t[i]: rows i, i+1 at columns 4L, 4L+1 (t[i+1]: 4L+2, 4L+3)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // lane L of r[g + c]: rows g..g+3 at column 4L + c
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // output row 4L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i p0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), p1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    const __m512i q0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i q1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    _mm512_storeu_si512(dst + c * dst_stride, _mm512_shuffle_i32x4(p0, q0, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * dst_stride, _mm512_shuffle_i32x4(p1, q1, 0x88));
    _mm512_storeu_si512(dst + (8 + c) * dst_stride, _mm512_shuffle_i32x4(p0, q0, 0xdd));
    _mm512_storeu_si512(dst + (12 + c) * dst_stride, _mm512_shuffle_i32x4(p1, q1, 0xdd));
  }
}

// dst[j][i] = src[i][j] for a rows x cols block of 32-bit words.
void TransposeWords(const uint32_t* src, int64_t src_stride, int64_t rows, int64_t cols, uint32_t* dst,
                    int64_t dst_stride) {
  if (rows % 16 == 0 && cols % 16 == 0) {
    for (int64_t i = 0; i < rows; i += 16) {
      for (int64_t j = 0; j < cols; j += 16) {
        Transpose16x16(src + i * src_stride + j, src_stride, dst + j * dst_stride + i, dst_stride);
      }
    }
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) dst[j * dst_stride + i] = src[i * src_stride + j];
  }
}

// Columns per packed column tile: 16 (one AMX B tile, one 512-bit vector).
constexpr int kColTile = 16;

// W_s VNNI-packed in column tiles: dst[j / CT][k / 2][j % CT][k % 2] = B[k][j] with
// CT = kColTile and B = w (fprop) or w^T (bprop), [BS, BS]. A B tile (32 values of k
// x 16 columns) is then 1 KiB of consecutive memory: rows 64 bytes apart do not compete
// for the same few L1 sets as rows BS * 4 bytes apart would.
template <int BS>
__attribute__((noinline)) void PackWeight(const uint16_t* w, bool transpose, uint16_t* dst) {
  constexpr int CT = kColTile;
  for (int ct = 0; ct < BS / CT; ++ct) {
    uint16_t* tile = dst + ct * CT * BS;  // [BS/2][CT][2]
    if (!transpose) {
      for (int k = 0; k < BS; k += 2)
        InterleaveRows(w + k * BS + ct * CT, w + (k + 1) * BS + ct * CT, tile + k * CT, CT);
    } else {
      // B[k][j] = w[j][k]: the pair (w[j][k], w[j][k+1]) is one 32-bit word of row j, so
      // this is a transpose of 32-bit words: [CT rows j][BS/2 pairs] -> [BS/2][CT].
      TransposeWords(reinterpret_cast<const uint32_t*>(w + ct * CT * BS), BS / 2, CT, BS / 2,
                     reinterpret_cast<uint32_t*>(tile), CT);
    }
  }
}

// ---------------------------------------------------------------------------------
// AMX tiles
// ---------------------------------------------------------------------------------
// Registers: tmm0..3 accumulators C[h][c] (row half h, column tile c), tmm4/5 the A rows
// of each half, tmm6/7 the B columns. One step: 2 A loads, NC B loads, 2 * NC products.

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles for `top` (1..16) and `bottom` (0..16) rows, a reduction of k_elems (16 or 32)
// bf16 per step and nc (1 or 2) column tiles of 16 floats.
void ConfigureTiles(int top, int bottom, int k_elems, int nc) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int h = 0; h < 2; ++h) {
    const int rows = h == 0 ? top : bottom;
    if (rows == 0) continue;
    cfg.rows[4 + h] = static_cast<uint8_t>(rows);
    cfg.colsb[4 + h] = static_cast<uint16_t>(2 * k_elems);
    for (int c = 0; c < nc; ++c) {
      cfg.rows[2 * h + c] = static_cast<uint8_t>(rows);
      cfg.colsb[2 * h + c] = 64;
    }
  }
  for (int c = 0; c < nc; ++c) {
    cfg.rows[6 + c] = static_cast<uint8_t>(k_elems / 2);
    cfg.colsb[6 + c] = 64;
  }
  // GCC does not see that LDTILECFG reads the struct and would drop the stores above.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// One product step: C[h][c] += A_h @ B_c for the configured halves and columns.
// a: the top A tile's first row (rows a_stride bytes apart), the bottom one a_next bf16
// further; b: the first B tile's first VNNI row (b_stride bytes), the second b_next further.
template <int NC, bool kBottom>
inline void AmxStep(const uint16_t* a, int64_t a_stride, int64_t a_next, const uint16_t* b, int64_t b_stride,
                    int64_t b_next) {
  // Each load as late as its first use: tiles are not renamed, so the next step's load
  // of a register waits for this step's last product that reads it.
  _tile_loadd(4, a, a_stride);
  _tile_loadd(6, b, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (NC == 2) {
    _tile_loadd(7, b + b_next, b_stride);
    _tile_dpbf16ps(1, 4, 7);
  }
  if constexpr (kBottom) {
    _tile_loadd(5, a + a_next, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NC == 2) _tile_dpbf16ps(3, 5, 7);
  }
}

template <int NC, bool kBottom>
inline void AmxZero() {
  _tile_zero(0);
  if constexpr (NC == 2) _tile_zero(1);
  if constexpr (kBottom) _tile_zero(2);
  if constexpr (kBottom && NC == 2) _tile_zero(3);
}

// C tiles <- / -> c (float32, row stride ldc floats), 16 floats per column tile.
template <int NC, bool kBottom>
inline void AmxLoadC(const float* c, int64_t ldc) {
  const int64_t stride = ldc * 4;
  _tile_loadd(0, c, stride);
  if constexpr (NC == 2) _tile_loadd(1, c + 16, stride);
  if constexpr (kBottom) _tile_loadd(2, c + 16 * ldc, stride);
  if constexpr (kBottom && NC == 2) _tile_loadd(3, c + 16 * ldc + 16, stride);
}

template <int NC, bool kBottom>
inline void AmxStoreC(float* c, int64_t ldc) {
  const int64_t stride = ldc * 4;
  _tile_stored(0, c, stride);
  if constexpr (NC == 2) _tile_stored(1, c + 16, stride);
  if constexpr (kBottom) _tile_stored(2, c + 16 * ldc, stride);
  if constexpr (kBottom && NC == 2) _tile_stored(3, c + 16 * ldc + 16, stride);
}

}  // namespace
}  // namespace bf16
}  // namespace cpu
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_CPU_BF16_TILES_H_
