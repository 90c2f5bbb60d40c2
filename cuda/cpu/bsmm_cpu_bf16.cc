// bfloat16 products on the CPU's matrix units: fprop, bprop (DSD) and updat (SDD) with
// AMX tiles (TDPBF16PS) or AVX512-BF16 dot products (VDPBF16PS), accumulating in float32.
//
// Compiled once, for x86-64, with the AMX and AVX512-BF16 flags (CMakeLists.txt); the
// dispatcher (bsmm_cpu_dispatch.cc) calls it only where the running CPU has the
// instructions (and, for AMX, the kernel granted this process the tile data). Like the
// per-instruction-set kernel files it uses no C++ library templates (see bsmm_cpu.h).
//
// The two engines, and what each reads:
//   AMX, one TDPBF16PS: C[16, 16] (float32) += A[16, 32] @ B[32, 16] (bf16). A's rows hold
//     32 consecutive bf16 of the reduction axis; B must be "VNNI-packed": row k/2 holds,
//     for each output column j, the pair (B[k][j], B[k + 1][j]). A block of 16 reduces
//     over 16 elements (half a tile's depth).
//   AVX512-BF16, one VDPBF16PS: 16 float32 lanes += a broadcast pair (A[r][k], A[r][k+1])
//     times one VNNI row of B (16 pairs).
// Blocks below kMinBlock (bsmm_cpu.h) do not come here.
//
//   fprop/bprop: out[rows, j] = sum over the slots s of column j of x[rows, in_block(s)] @ W_s
//     with W_s = w[s] (fprop) or w[s]^T (bprop). Every W_s is VNNI-packed once per call in
//     column tiles (PackWeight); on AMX each work item copies its rows of x (or dy) into
//     A tiles (PackedRows), the dot engine reads them in place.
//   updat: dw[s] = x[:, row block]^T @ dy[:, column block], reduced over the rows n.
//     A = x^T needs the rows' axis contiguous: x is packed transposed per block
//     (PackXTransposed); dy is VNNI-packed along the rows in column tiles (PackDyPairs).
//     Rows are zero-padded to a multiple of 32 and processed in chunks that fit a budget.
//
// Summation order: per output element, the products are added in slot order and, within
// a block, in pairs of the reduction axis (AMX: 16 pairs per instruction, an order the
// hardware fixes); updat adds chunk by chunk of rows. Results match the float32-widening
// kernels within bfloat16 rounding, not bit for bit. AMX and AVX512-BF16 treat denormal
// bf16 inputs as zero; outputs narrowed to bf16 round to nearest even, as XLA does.
//
// The packing routines are kept out of line (noinline), so that a profile shows their
// share of a call apart from the products' (the docs' performance page quotes it).
//
// Tile state is per thread: every work item loads its tile configuration first and
// releases the tiles when it ends, so nothing is left configured between items, calls
// or threads.
#if defined(JBS_CPU_BF16_KERNELS)

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "bsmm_block_sizes.h"
#include "bsmm_problem.h"
#include "cpu/bf16_tiles.h"  // narrowing, VNNI packing, AMX tile steps
#include "cpu/bsmm_cpu.h"
#include "cpu/cpu_simd.h"  // buffers, Min/Max/CeilDiv, FloatToBf16 (needs JBS_CPU_ISA: bf16)

namespace jbs {
namespace cpu {
namespace bf16 {
namespace {

// ---------------------------------------------------------------------------------
// AVX512-BF16 register tile
// ---------------------------------------------------------------------------------

// C[r][j] (+)= sum over kp < pairs of A[r][2kp..2kp+1] . B[kp][j][0..1] for r < R,
// j < NV * 16. A row stride a_row bf16; B's columns in tiles of 16 (b_vec bf16 apart),
// each row of a tile (one pair of the reduction axis) b_row bf16 apart; C row stride ldc
// floats.
template <int NV, int R>
void DotTile(int64_t pairs, const uint16_t* A, int64_t a_row, const uint16_t* B, int64_t b_row, int64_t b_vec, float* C,
             int64_t ldc, bool load) {
  __m512 c[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = load ? _mm512_loadu_ps(C + r * ldc + v * 16) : _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(B + kp * b_row + v * b_vec);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, A + r * a_row + 2 * kp, 4);
      const __m512i a = _mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], (__m512bh)a, (__m512bh)b[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + v * 16, c[r][v]);
}

// The register tile per block size: NV vectors of 16 lanes per row, R rows (R * NV
// accumulators + NV + 1 of the 32 vector registers).
template <int BS>
struct DotShape {
  static constexpr int kVectors = BS == 16 ? 1 : 2;
  static constexpr int kRows = kVectors == 2 ? 8 : 16;
};

// C[rows, BS] (+)= A[rows, 2 * pairs] @ B with the dot engine; B VNNI-packed in column
// tiles of kColTile ([BS / CT][pairs][CT][2]).
template <int BS>
void DotProduct(int64_t rows, int64_t pairs, const uint16_t* A, int64_t a_row, const uint16_t* B, float* C, int64_t ldc,
                bool load) {
  constexpr int NV = DotShape<BS>::kVectors, R = DotShape<BS>::kRows;
  constexpr int CT = kColTile;
  const int64_t b_vec = pairs * 2 * CT;  // one column tile
  const int64_t full = rows - rows % R;
  for (int j = 0; j < BS; j += NV * 16) {
    const uint16_t* b = B + (j / CT) * b_vec;
    for (int64_t r = 0; r < full; r += R) {
      DotTile<NV, R>(pairs, A + r * a_row, a_row, b, 2 * CT, b_vec, C + r * ldc + j, ldc, load);
    }
    for (int64_t r = full; r < rows; ++r) {
      DotTile<NV, 1>(pairs, A + r * a_row, a_row, b, 2 * CT, b_vec, C + r * ldc + j, ldc, load);
    }
  }
}

// ---------------------------------------------------------------------------------
// Scratch
// ---------------------------------------------------------------------------------

struct Scratch {
  alignas(64) float acc[128 * 128];
};

Scratch& ThreadScratch() {
  static thread_local Scratch scratch;
  return scratch;
}

// Per-thread buffers of the fprop/bprop work items, kept between calls (floats' storage):
// a segment's valid slots (int32), the item's rows of the lhs in A tiles (bf16), and which
// input blocks those rows hold (bytes).
enum ItemBuffer { kSlots, kRows, kUsed, kItemBuffers };

Buffer& ThreadBuffer(ItemBuffer which) {
  static thread_local Buffer buffers[kItemBuffers];
  return buffers[which];
}

// Packed activations of one chunk of rows (updat) stay under this many bytes.
constexpr int64_t kPackBytes = int64_t{32} << 20;

// A buffer of `count` bf16 from the caller's buffers (Buffer counts floats).
uint16_t* Bf16Buffer(int which, int64_t count) {
  return reinterpret_cast<uint16_t*>(CallerBuffer(which).Get(CeilDiv(Max(count, 1), 2)));
}

// ---------------------------------------------------------------------------------
// DSD: fprop and bprop
// ---------------------------------------------------------------------------------

struct DsdJob {
  const DsdParams* p;
  Engine engine;
  bool out_f32;
  bool transpose_w;
  int64_t nnz;
  uint16_t* packed_w;  // [nnz][bs/2][bs][2]
  int64_t tiles;       // row tiles
  int64_t tile_rows;   // a multiple of 32
  int64_t groups;      // output blocks are dealt round-robin into this many groups
};

template <int BS>
void DsdPackItem(void* arg, int64_t slot) {
  const DsdJob& job = *static_cast<const DsdJob*>(arg);
  const uint16_t* w = static_cast<const uint16_t*>(job.p->w) + slot * BS * BS;
  PackWeight<BS>(w, job.transpose_w, job.packed_w + slot * BS * BS);
}

// The valid slot of entry e of the segment, or -1 (padding, out-of-range tables).
inline int64_t DsdSlot(const DsdJob& job, int64_t e) {
  const DsdParams& p = *job.p;
  const int64_t slot = p.seg_slots ? p.seg_slots[e] : e;
  if (slot < 0 || slot >= job.nnz) return -1;
  const int64_t block = p.in_block[slot];
  return block >= 0 && block < p.nin ? slot : -1;
}

// Writes acc [rows, cols] (row stride ldc) to out rows [row, row + rows) at column col.
void StoreOutput(const DsdJob& job, const float* acc, int64_t ldc, int64_t row, int64_t rows, int64_t col,
                 int64_t cols) {
  const int64_t fout = int64_t{job.p->nseg} * job.p->bs;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = acc + r * ldc;
    if (job.out_f32) {
      std::memcpy(static_cast<float*>(job.p->out) + (row + r) * fout + col, src, sizeof(float) * cols);
    } else {
      NarrowRow(src, static_cast<uint16_t*>(job.p->out) + (row + r) * fout + col, cols);
    }
  }
}

// A work item's rows of the lhs, copied into AMX A tiles: for rows [first, first + rows)
// and input block b, the kStep columns from k0 of row r are at
// data[((b * BS / kStep + k0 / kStep) * rows + r - first) * kStep]: 16 rows of a tile are
// 16 x kStep consecutive bf16, which the prefetchers stream and L1 keeps whole, where
// rows of x are nin * BS * 2 bytes apart (8 KiB at 4096 features: one L1 set for all).
template <int BS>
struct PackedRows {
  static constexpr int kStep = BS < 32 ? BS : 32;  // reduction elements per AMX step
  const uint16_t* data;
  int64_t first, rows;
  int64_t lda = 0;  // > 0: `data` is the input itself, its rows lda elements apart (no copy)
  const uint16_t* Tile(int64_t r, int64_t block, int k0) const {
    if (lda > 0) return data + r * lda + block * BS + k0;
    return data + ((block * (BS / kStep) + k0 / kStep) * rows + (r - first)) * kStep;
  }
  int64_t Stride() const { return 2 * (lda > 0 ? lda : kStep); }  // bytes between a tile's rows
  int64_t Next() const { return 16 * (lda > 0 ? lda : kStep); }   // elements to the next 16 rows
};

// Input rows at most this many bytes apart are read by the A tiles where they are: the 16
// rows of a tile then fall in four L1 sets (of 64), four lines each, and span four pages.
// Wider rows are copied into tiles first (PackLhsRows): 4 KiB apart, every row of a tile
// falls in one set, and at 2 KiB the copy measured no slower than reading in place. For a
// small product the copy costs about as much as the products: at 256 x 512 with 6 blocks
// of 64 it took 18% of the time, and reading in place cut the call from 97 to 67 us.
constexpr int64_t kDirectRowBytes = 1024;

// Copies rows [first, first + rows) of the input blocks marked in `used` into dst.
template <int BS>
__attribute__((noinline)) void PackLhsRows(const DsdParams& p, const uint8_t* used, int64_t first, int64_t rows,
                                           uint16_t* dst) {
  constexpr int kStep = PackedRows<BS>::kStep;
  const int64_t lda = int64_t{p.nin} * BS;
  const uint16_t* x = static_cast<const uint16_t*>(p.a);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + (first + r) * lda;
    for (int64_t b = 0; b < p.nin; ++b) {
      if (!used[b]) continue;
      for (int k0 = 0; k0 < BS; k0 += kStep) {
        std::memcpy(dst + ((b * (BS / kStep) + k0 / kStep) * rows + r) * kStep, row + b * BS + k0, kStep * 2);
      }
    }
  }
}

// Rows [r0, r0 + 32) (or fewer: kBottom false for at most 16) of the segment's output,
// columns [c0, c0 + 16 * NC), summed over its valid slots (slots[0, count)) in the tiles.
template <int BS, int NC, bool kBottom>
void DsdAmxRows(const DsdJob& job, const PackedRows<BS>& pa, const int32_t* slots, int64_t count, int64_t seg,
                int64_t r0, int64_t rows, int64_t c0) {
  const DsdParams& p = *job.p;
  constexpr int kStep = PackedRows<BS>::kStep;
  AmxZero<NC, kBottom>();
  for (int64_t s = 0; s < count; ++s) {
    const int64_t slot = slots[s];
    const uint16_t* b = job.packed_w + slot * BS * BS + c0 * BS;
    for (int k0 = 0; k0 < BS; k0 += kStep) {
      AmxStep<NC, kBottom>(pa.Tile(r0, p.in_block[slot], k0), pa.Stride(), pa.Next(), b + k0 * 16, 64, 16 * BS);
    }
  }
  const int64_t fout = int64_t{p.nseg} * BS;
  if (job.out_f32 && rows == (kBottom ? 32 : 16)) {
    AmxStoreC<NC, kBottom>(static_cast<float*>(p.out) + r0 * fout + seg * BS + c0, fout);
    return;
  }
  float* acc = ThreadScratch().acc;  // [32][32]
  AmxStoreC<NC, kBottom>(acc, 32);
  StoreOutput(job, acc, 32, r0, rows, seg * BS + c0, 16 * NC);
}

// `rows` rows of kBytes zero bytes, `stride` bytes apart. The row's size is a constant, so
// each is a few vector stores: a memset of a size known only at run time became `rep stos`,
// whose start-up cost made zeroing an output block cost a quarter of a small product.
template <int kBytes>
void ZeroRows(char* first, int64_t stride, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) std::memset(first + r * stride, 0, kBytes);
}

// Reduction elements per pass: a B panel of kChunk x 32 columns (16 KiB) stays in L1 while
// the rows stream past it; the partial sums wait in an L1 accumulator between passes.
constexpr int64_t kChunk = 256;

// Rows [first, first + rows) of the segment's output: whole groups of 32 rows in blocks of
// up to 128 rows (a float32 accumulator of 128 x 32), by passes over chunks of the
// segment's slots; the tail of fewer than 32 rows with its tiles configured to fit.
template <int BS>
void DsdAmxItem(const DsdJob& job, const PackedRows<BS>& pa, int64_t seg, int64_t first, int64_t rows) {
  constexpr int kStep = PackedRows<BS>::kStep;
  constexpr int NC = BS < 32 ? 1 : 2;
  constexpr int kCols = 16 * NC;
  constexpr int64_t kChunkSlots = kChunk / BS > 0 ? kChunk / BS : 1;
  const DsdParams& p = *job.p;
  const int64_t entries = p.seg_ptr[seg + 1] - p.seg_ptr[seg];
  int32_t* slots = reinterpret_cast<int32_t*>(ThreadBuffer(kSlots).Get(Max(entries, 1)));
  if (slots == nullptr) return;  // no memory: cannot happen for the sizes a layout has
  int64_t count = 0;
  for (int64_t e = p.seg_ptr[seg]; e < p.seg_ptr[seg + 1]; ++e) {
    const int64_t slot = DsdSlot(job, e);
    if (slot >= 0) slots[count++] = static_cast<int32_t>(slot);
  }
  if (count == 0) {  // an output block no slot feeds: zeros (0.0 is all-zero bits in every dtype)
    const int64_t fout = int64_t{p.nseg} * BS;
    if (job.out_f32) {
      ZeroRows<BS * 4>(static_cast<char*>(p.out) + (first * fout + seg * BS) * 4, fout * 4, rows);
    } else {
      ZeroRows<BS * 2>(static_cast<char*>(p.out) + (first * fout + seg * BS) * 2, fout * 2, rows);
    }
    return;
  }
  const int64_t full = rows - rows % 32;
  float* acc = ThreadScratch().acc;  // [128][kCols]
  if (full > 0) {
    ConfigureTiles(16, 16, kStep, NC);
    for (int c0 = 0; c0 < BS; c0 += kCols) {
      for (int64_t b0 = first; b0 < first + full; b0 += 128) {
        const int64_t m = Min(128, first + full - b0);
        for (int64_t s0 = 0; s0 < count; s0 += kChunkSlots) {
          const int64_t s1 = Min(count, s0 + kChunkSlots);
          for (int64_t r = 0; r < m; r += 32) {
            float* c = acc + r * kCols;
            if (s0 == 0) {
              AmxZero<NC, true>();
            } else {
              AmxLoadC<NC, true>(c, kCols);
            }
            for (int64_t s = s0; s < s1; ++s) {
              const int64_t block = p.in_block[slots[s]];
              const uint16_t* b = job.packed_w + int64_t{slots[s]} * BS * BS + c0 * BS;
              for (int k0 = 0; k0 < BS; k0 += kStep) {
                AmxStep<NC, true>(pa.Tile(b0 + r, block, k0), pa.Stride(), pa.Next(), b + k0 * 16, 64, 16 * BS);
              }
            }
            AmxStoreC<NC, true>(c, kCols);
          }
        }
        StoreOutput(job, acc, kCols, b0, m, seg * BS + c0, kCols);
      }
    }
  }
  const int64_t tail = rows - full;
  if (tail > 0) {
    ConfigureTiles(static_cast<int>(Min(tail, 16)), static_cast<int>(Max(tail - 16, 0)), kStep, NC);
    for (int c0 = 0; c0 < BS; c0 += kCols) {
      if (tail > 16) {
        DsdAmxRows<BS, NC, true>(job, pa, slots, count, seg, first + full, tail, c0);
      } else {
        DsdAmxRows<BS, NC, false>(job, pa, slots, count, seg, first + full, tail, c0);
      }
    }
  }
  _tile_release();
}

template <int BS>
void DsdDotItem(const DsdJob& job, int64_t seg, int64_t first, int64_t rows) {
  const DsdParams& p = *job.p;
  const int64_t lda = int64_t{p.nin} * BS;
  const uint16_t* x = static_cast<const uint16_t*>(p.a);
  float* acc = ThreadScratch().acc;  // [rows <= 128][BS]
  for (int64_t r0 = first; r0 < first + rows; r0 += 128 * 128 / BS) {
    const int64_t m = Min(128 * 128 / BS, first + rows - r0);
    bool load = false;
    for (int64_t e = p.seg_ptr[seg]; e < p.seg_ptr[seg + 1]; ++e) {
      const int64_t slot = DsdSlot(job, e);
      if (slot < 0) continue;
      const uint16_t* a = x + r0 * lda + int64_t{p.in_block[slot]} * BS;
      DotProduct<BS>(m, BS / 2, a, lda, job.packed_w + slot * BS * BS, acc, BS, load);
      load = true;
    }
    if (!load) std::memset(acc, 0, sizeof(float) * m * BS);
    StoreOutput(job, acc, BS, r0, m, seg * BS, BS);
  }
}

template <int BS>
void DsdItem(void* arg, int64_t item) {
  const DsdJob& job = *static_cast<const DsdJob*>(arg);
  const DsdParams& p = *job.p;
  const int64_t first = (item % job.tiles) * job.tile_rows;
  const int64_t rows = Min(job.tile_rows, p.n - first);
  if (rows <= 0) return;
  // One tile of rows through every output block of the group: the rows' input stays in
  // L2 for all of them, where one item per output block would read it again each time.
  const int64_t group = item / job.tiles;
  if (job.engine == Engine::kAmx) {
    const int64_t lda = int64_t{p.nin} * BS;
    PackedRows<BS> pa{static_cast<const uint16_t*>(p.a), first, rows, lda};  // read in place
    if (2 * lda > kDirectRowBytes) {
      // The input blocks the group reads, copied once into A tiles.
      uint8_t* used = reinterpret_cast<uint8_t*>(ThreadBuffer(kUsed).Get(CeilDiv(int64_t{p.nin} + 1, 4)));
      uint16_t* packed = reinterpret_cast<uint16_t*>(ThreadBuffer(kRows).Get(CeilDiv(rows * p.nin * BS, 2)));
      if (used == nullptr || packed == nullptr) return;  // no memory for a tile of rows: cannot happen at <= 1 MiB
      std::memset(used, 0, p.nin);
      for (int64_t q = group; q < p.nseg; q += job.groups) {
        const int64_t seg = p.order[q];
        if (seg < 0 || seg >= p.nseg) continue;
        for (int64_t e = p.seg_ptr[seg]; e < p.seg_ptr[seg + 1]; ++e) {
          const int64_t slot = DsdSlot(job, e);
          if (slot >= 0) used[p.in_block[slot]] = 1;
        }
      }
      PackLhsRows<BS>(p, used, first, rows, packed);
      pa = PackedRows<BS>{packed, first, rows};
    }
    for (int64_t q = group; q < p.nseg; q += job.groups) {
      const int64_t seg = p.order[q];
      if (seg >= 0 && seg < p.nseg) DsdAmxItem<BS>(job, pa, seg, first, rows);
    }
    return;
  }
  for (int64_t q = group; q < p.nseg; q += job.groups) {
    const int64_t seg = p.order[q];
    if (seg < 0 || seg >= p.nseg) continue;  // not a permutation: the handler's contract is broken
    DsdDotItem<BS>(job, seg, first, rows);
  }
}

template <int BS>
bool RunDsdBlock(DsdJob& job, const Parallel& par) {
  const DsdParams& p = *job.p;
  job.packed_w = Bf16Buffer(0, Max(job.nnz, 1) * BS * BS);
  if (job.packed_w == nullptr) return false;
  if (job.nnz > 0) par.for_each(par.ctx, job.nnz, &DsdPackItem<BS>, &job);
  // Items: a tile of rows (32-row multiples: whole AMX tile pairs) x a group of output
  // blocks. A tile's input rows ([rows, nin * BS] bf16) stay under 1 MiB so that they
  // live in L2 across its group; at least 4 items per worker for the load balance, the
  // groups dealt round-robin from `order` (longest first) so that they weigh alike.
  const int64_t rows32 = CeilDiv(Max(p.n, 1), 32);
  const int64_t l2_rows32 = Max(1, (int64_t{1} << 20) / (int64_t{p.nin} * BS * 2 * 32));
  job.tile_rows = Min(Min(rows32, l2_rows32), 8) * 32;
  job.tiles = CeilDiv(Max(p.n, 1), job.tile_rows);
  job.groups = Max(1, Min(int64_t{p.nseg}, CeilDiv(4 * int64_t{par.workers}, job.tiles)));
  par.for_each(par.ctx, job.tiles * job.groups, &DsdItem<BS>, &job);
  return true;
}

// ---------------------------------------------------------------------------------
// SDD: updat
// ---------------------------------------------------------------------------------

struct SddJob {
  const SddParams* p;
  Engine engine;
  bool out_f32;
  int64_t nnz;
  int64_t row0, rows;  // the chunk of rows
  int64_t padded;      // rows rounded up to 32 (zero rows after `rows`)
  bool first, last;
  uint16_t* xt;         // [cb][bs * padded]: x's blocks transposed (PackXTransposed)
  uint16_t* dyv;        // [kb][bs * padded]: dy's blocks VNNI-packed along the rows (PackDyPairs)
  float* accumulators;  // [cap][bs][bs] float32 (dw itself, or scratch), or nullptr
  const uint8_t* used;  // [cb + kb]: whether a valid slot reads x's block (then dy's)
};

// x's block `item` transposed, xt[i][n] = x[row0 + n][item * BS + i], in the engine's
// layout: AMX tiles ([BS/16][padded/32][16][32]: one A tile = 1 KiB of consecutive memory)
// or rows ([BS][padded]) for the dot engine. Per 32 rows: rows n, n+1 interleaved into
// 32-bit pairs (pairs[n/2][i]), then the pairs transposed: row i holds x[n0 .. n0+32)[i].
template <int BS>
__attribute__((noinline)) void PackXTransposed(const SddJob& job, int64_t item) {
  const SddParams& p = *job.p;
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + item * BS;
  const int64_t ldx = int64_t{p.cb} * BS;
  uint16_t* dst = job.xt + item * BS * job.padded;
  const bool tiles = job.engine == Engine::kAmx;
  alignas(64) uint16_t pairs[16 * 2 * BS];
  for (int64_t n0 = 0; n0 < job.padded; n0 += 32) {
    for (int64_t q = 0; q < 16; ++q) {
      const int64_t n = n0 + 2 * q;
      const uint16_t* r0 = n < job.rows ? x + (job.row0 + n) * ldx : kZeros;
      const uint16_t* r1 = n + 1 < job.rows ? x + (job.row0 + n + 1) * ldx : kZeros;
      InterleaveRows(r0, r1, pairs + q * 2 * BS, BS);
    }
    const uint32_t* words = reinterpret_cast<const uint32_t*>(pairs);
    if (!tiles) {
      TransposeWords(words, BS, 16, BS, reinterpret_cast<uint32_t*>(dst + n0), job.padded / 2);
      continue;
    }
    for (int i0 = 0; i0 < BS; i0 += 16) {  // the A tile of rows i0.. and reduction n0..
      uint16_t* tile = dst + ((i0 / 16) * (job.padded / 32) + n0 / 32) * 512;
      Transpose16x16(words + i0, BS, reinterpret_cast<uint32_t*>(tile), 16);
    }
  }
}

// dy's block VNNI-packed along the rows in column tiles:
// dyv[j / CT][n / 2][j % CT][n % 2] = dy[row0 + n][block * BS + j], CT = kColTile.
template <int BS>
__attribute__((noinline)) void PackDyPairs(const SddJob& job, int64_t block) {
  constexpr int CT = kColTile;
  const SddParams& p = *job.p;
  const uint16_t* dy = static_cast<const uint16_t*>(p.dy) + block * BS;
  const int64_t ldy = int64_t{p.kb} * BS;
  uint16_t* dst = job.dyv + block * BS * job.padded;
  for (int64_t n = 0; n < job.padded; n += 2) {
    const uint16_t* r0 = n < job.rows ? dy + (job.row0 + n) * ldy : kZeros;
    const uint16_t* r1 = n + 1 < job.rows ? dy + (job.row0 + n + 1) * ldy : kZeros;
    for (int ct = 0; ct < BS / CT; ++ct) {
      InterleaveRows(r0 + ct * CT, r1 + ct * CT, dst + ct * job.padded * CT + n * CT, CT);
    }
  }
}

template <int BS>
void SddPackItem(void* arg, int64_t item) {
  const SddJob& job = *static_cast<const SddJob*>(arg);
  const int64_t cb = job.p->cb;
  if (!job.used[item]) return;
  if (item < cb) {
    PackXTransposed<BS>(job, item);
  } else {
    PackDyPairs<BS>(job, item - cb);
  }
}

// acc[BS][BS] (+)= xt^T-block @ dyv-block over this chunk of rows, in passes over kChunk
// rows: the A panel of 32 (or 16) rows of xt stays in L1 across the column tiles.
template <int BS>
void SddAmx(const SddJob& job, const uint16_t* xt, const uint16_t* dyv, float* acc) {
  constexpr int NC = BS < 32 ? 1 : 2;
  constexpr bool kBottom = BS >= 32;
  constexpr int kRows = kBottom ? 32 : 16, kCols = 16 * NC;
  ConfigureTiles(16, kBottom ? 16 : 0, 32, NC);
  for (int64_t n0 = 0; n0 < job.padded; n0 += kChunk) {
    const int64_t n1 = Min(job.padded, n0 + kChunk);
    for (int i0 = 0; i0 < BS; i0 += kRows) {
      for (int j0 = 0; j0 < BS; j0 += kCols) {
        float* c = acc + i0 * BS + j0;
        if (job.first && n0 == 0) {
          AmxZero<NC, kBottom>();
        } else {
          AmxLoadC<NC, kBottom>(c, BS);
        }
        const uint16_t* a = xt + (i0 / 16) * (job.padded / 32) * 512;  // A tiles: 512 bf16 per 32 rows
        const uint16_t* b = dyv + j0 * job.padded;                     // B tiles: 16 bf16 per row
        for (int64_t k0 = n0; k0 < n1; k0 += 32) {
          AmxStep<NC, kBottom>(a + k0 * 16, 64, job.padded * 16, b + k0 * 16, 64, job.padded * 16);
        }
        AmxStoreC<NC, kBottom>(c, BS);
      }
    }
  }
  _tile_release();
}

template <int BS>
void SddItem(void* arg, int64_t slot) {
  const SddJob& job = *static_cast<const SddJob*>(arg);
  const SddParams& p = *job.p;
  const int64_t row_block = slot < job.nnz ? p.block_rows[slot] : -1;
  const int64_t col_block = slot < job.nnz ? p.block_cols[slot] : -1;
  const bool valid = row_block >= 0 && row_block < p.cb && col_block >= 0 && col_block < p.kb;
  float* acc = job.accumulators ? job.accumulators + slot * BS * BS : ThreadScratch().acc;
  if (!valid || job.rows <= 0) {
    if (job.first) std::memset(acc, 0, sizeof(float) * BS * BS);  // padding stays zero
  } else {
    const uint16_t* xt = job.xt + row_block * BS * job.padded;
    const uint16_t* dyv = job.dyv + col_block * BS * job.padded;
    if (job.engine == Engine::kAmx) {
      SddAmx<BS>(job, xt, dyv, acc);
    } else {
      DotProduct<BS>(BS, job.padded / 2, xt, job.padded, dyv, acc, BS, !job.first);
    }
  }
  if (job.last && !job.out_f32) NarrowRow(acc, static_cast<uint16_t*>(p.dw) + slot * BS * BS, BS * BS);
}

template <int BS>
bool RunSddBlock(SddJob& job, const Parallel& par) {
  const SddParams& p = *job.p;
  const int64_t per_row_bytes = (int64_t{p.cb} + p.kb) * BS * 2;
  const int64_t chunk = Max(32, (kPackBytes / Max(per_row_bytes, 1)) / 32 * 32);
  const int64_t chunks = Max(1, CeilDiv(p.n, chunk));
  const int64_t padded_max = CeilDiv(Min(chunk, Max(p.n, 1)), 32) * 32;
  job.xt = Bf16Buffer(0, padded_max * Max(1, p.cb) * BS);
  job.dyv = Bf16Buffer(1, padded_max * Max(1, p.kb) * BS);
  if (job.xt == nullptr || job.dyv == nullptr) return false;
  // Only the blocks some slot reads are packed.
  uint8_t* used = reinterpret_cast<uint8_t*>(CallerBuffer(3).Get(CeilDiv(int64_t{p.cb} + p.kb + 1, 4)));
  if (used == nullptr) return false;
  std::memset(used, 0, int64_t{p.cb} + p.kb);
  for (int64_t s = 0; s < job.nnz; ++s) {
    const int64_t row_block = p.block_rows[s], col_block = p.block_cols[s];
    if (row_block >= 0 && row_block < p.cb && col_block >= 0 && col_block < p.kb) {
      used[row_block] = 1;
      used[p.cb + col_block] = 1;
    }
  }
  job.used = used;
  bool ok;
  job.accumulators = SddAccumulators(p, job.out_f32, chunks, &ok);
  if (!ok) return false;
  for (int64_t c = 0; c < chunks; ++c) {
    job.row0 = c * chunk;
    job.rows = Max(0, Min(chunk, p.n - job.row0));
    job.padded = CeilDiv(job.rows, 32) * 32;
    job.first = c == 0;
    job.last = c == chunks - 1;
    if (job.rows > 0) par.for_each(par.ctx, int64_t{p.cb} + p.kb, &SddPackItem<BS>, &job);
    par.for_each(par.ctx, p.cap, &SddItem<BS>, &job);
  }
  return true;
}

}  // namespace

bool RunDsd(Engine engine, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par) {
  DsdJob job{};
  job.p = &p;
  job.engine = engine;
  job.out_f32 = out_f32;
  job.transpose_w = transpose_w;
  job.nnz = SlotsInUse(p.nnz, p.cap);
  return ForTileBlockSize(p.bs, [&](auto bs) { return RunDsdBlock<decltype(bs)::value>(job, par); });
}

bool RunSdd(Engine engine, bool out_f32, const SddParams& p, const Parallel& par) {
  SddJob job{};
  job.p = &p;
  job.engine = engine;
  job.out_f32 = out_f32;
  job.nnz = SlotsInUse(p.nnz, p.cap);
  return ForTileBlockSize(p.bs, [&](auto bs) { return RunSddBlock<decltype(bs)::value>(job, par); });
}

double TilePeakFlops(int64_t steps) {
  // 2 x 2 accumulators on operands that never leave the tiles: the rate of TDPBF16PS alone.
  ConfigureTiles(16, 16, 32, 2);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  AmxZero<2, true>();
  for (int64_t i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_release();
  return static_cast<double>(steps) * 4 * 16 * 16 * 32 * 2;
}

}  // namespace bf16
}  // namespace cpu
}  // namespace jbs

#endif  // JBS_CPU_BF16_KERNELS
