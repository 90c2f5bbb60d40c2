// CPU kernels of fprop, bprop (DSD) and updat (SDD), compiled once per instruction set.
//
// build.py compiles this file with -DJBS_CPU_ISA=<namespace> -DJBS_CPU_LANES=<floats per
// vector register> and the matching -m flags (baseline: 4, avx2: 8, avx512: 16). Read
// bsmm_cpu.h first: this file must not use C++ library templates (see there why).
//
// Every product is a sum of small dense products accumulated in float32 by one register
// tile routine, Tile<L, NV, R>: C[R rows][NV vectors of L floats] += A[R, K] @ B[K, NV*L],
// with A read one scalar at a time (broadcast) and B one row of vectors at a time. The
// accumulators of a tile stay in registers for the whole K loop.
//
//   fprop/bprop, one work item = one output block column/row j x one tile of rows:
//     acc[rows, bs] = sum over the segment's slots s of A_s[rows, bs] @ W_s[bs, bs]
//     with A_s the lhs rows at input block in_block[s] (read in place when float32 at
//     blocks 64 and 128, a run of consecutive input blocks then one product; else from a
//     block-major widened copy) and W_s = w[s] (or w[s]^T, transposed once per call).
//     With AVX-512, blocks of 8 to 32 in a dense enough layout run as column panels
//     instead: one item = 128 / bs output blocks x one tile of rows, their weights read
//     where they lie (float32 fprop, InPlacePanel) or copied into one panel (the others,
//     widened or transposed; RunDsdPanels).
//   updat, one work item = one slot s (with AVX-512, blocks of 8 and 16 in a dense enough
//   layout run as 128 x 128 tiles of dW instead, RunSddPanels):
//     dw[s][bs, bs] = sum over tiles of rows of X_s[rows, bs]^T @ DY_s[rows, bs]
//     (A = X_s^T is read with strides (1, row stride): no transpose is materialised).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <sched.h>  // sched_yield

#include "bsmm_block_sizes.h"
#include "bsmm_problem.h"
#include "cpu/bsmm_cpu.h"
#include "cpu/cpu_simd.h"  // 16-bit conversions, vector types, Splat, buffers (needs JBS_CPU_ISA)

namespace jbs {
namespace cpu {
namespace JBS_CPU_ISA {
namespace {

// ---------------------------------------------------------------------------------
// The register tile
// ---------------------------------------------------------------------------------

// C[r * ldc + j] += sum_k A[r * a_row + k * a_k] * B[k * ldb + j] for r < R, j < NV * L
// (= where `zero`: the sums start from zero, C is not read).
template <int L, int NV, int R>
inline void Tile(int64_t K, const float* A, int64_t a_row, int64_t a_k, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool zero = false) {
  typedef typename VecOf<L>::type V;
  typedef typename VecOf<L>::unaligned U;
  V c[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) c[r][v] = zero ? V{} : *reinterpret_cast<const U*>(C + r * ldc + v * L);
  for (int64_t k = 0; k < K; ++k) {
    V b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = *reinterpret_cast<const U*>(B + k * ldb + v * L);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V a = Splat<V, L>(A + r * a_row + k * a_k);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) *reinterpret_cast<U*>(C + r * ldc + v * L) = c[r][v];
}

// Tile shape per instruction set and block size: L floats per vector, NV vectors per
// row, R rows. R * NV accumulators + NV + 1 registers fit the register file (16 vector
// registers below AVX-512, 32 with it). Each step of k loads NV vectors of B and
// broadcasts R scalars of A for R * NV FMAs: with 32 registers, 6 x 4 (24 FMAs per 10
// loads) keeps the FMA units fed where 8 x 2 (16 per 10) waits on loads. (12 x 2 for
// block 32 measured no faster than 8 x 2.)
template <int BS>
struct TileShape {
  static constexpr int kLanes = JBS_CPU_LANES < BS ? JBS_CPU_LANES : BS;
  static constexpr int kWide = JBS_CPU_LANES == 16 && BS / kLanes >= 4;  // 4 vectors per row
  static constexpr int kVectors = kWide ? 4 : BS / kLanes < 2 ? BS / kLanes : 2;
  static constexpr int kRows = kWide ? 6 : JBS_CPU_LANES == 16 || kVectors == 1 ? 8 : 4;
};

// Rows [0, rows) of a column panel with tiles of fewer than R rows: R / 2, then one by one.
template <int L, int NV, int R>
inline void TailRows(int64_t rows, int64_t K, const float* A, int64_t a_row, int64_t a_k, const float* B, int64_t ldb,
                     float* C, int64_t ldc, bool zero = false) {
  int64_t r = 0;
  if (R >= 4) {
    for (; r + R / 2 <= rows; r += R / 2) {
      Tile<L, NV, R / 2>(K, A + r * a_row, a_row, a_k, B, ldb, C + r * ldc, ldc, zero);
    }
  }
  for (; r < rows; ++r) Tile<L, NV, 1>(K, A + r * a_row, a_row, a_k, B, ldb, C + r * ldc, ldc, zero);
}

// C[rows, BS] += A[rows, K] @ B[K, BS] (= where `zero`; A with strides a_row, a_k; B and C
// row-major).
// Always inlined: each caller's constant strides then reach the tiles' loops (out of
// line, with the strides unknown, block 16 ran 2x slower).
template <int BS>
__attribute__((always_inline)) inline void Gemm(int64_t rows, int64_t K, const float* A, int64_t a_row, int64_t a_k,
                                                const float* B, int64_t ldb, float* C, int64_t ldc, bool zero = false) {
  constexpr int L = TileShape<BS>::kLanes, NV = TileShape<BS>::kVectors, R = TileShape<BS>::kRows;
  const int64_t full = rows - rows % R;  // rows in whole tiles; the rest in smaller ones
  for (int j = 0; j < BS; j += NV * L) {
    for (int64_t r = 0; r < full; r += R) {
      Tile<L, NV, R>(K, A + r * a_row, a_row, a_k, B + j, ldb, C + r * ldc + j, ldc, zero);
    }
    TailRows<L, NV, R>(rows - full, K, A + full * a_row, a_row, a_k, B + j, ldb, C + full * ldc + j, ldc, zero);
  }
}

// ---------------------------------------------------------------------------------
// Scratch
// ---------------------------------------------------------------------------------

constexpr int64_t kBlockFloats = 128 * 128;
// Packed operands of one chunk of rows (float32, block-major) stay under this size;
// longer inputs are processed in several chunks of rows.
constexpr int64_t kPackFloats = int64_t{4} << 20;  // 16 MiB
// Widened (transposed) weight blocks for one call stay under this size, else each row
// tile widens the blocks it uses.
constexpr int64_t kPackWeightFloats = int64_t{64} << 20;  // 256 MiB

// Per worker thread: one widened (transposed) weight block and one [bs, bs] accumulator.
struct Scratch {
  alignas(64) float w[kBlockFloats];
  alignas(64) float acc[kBlockFloats];
};

Scratch& ThreadScratch() {
  static thread_local Scratch scratch;
  return scratch;
}

// Widens rows [row0, row0 + rows) of block `block` of src [n, blocks * BS] into
// dst [rows, BS] (the block's slice of a block-major [blocks][rows][BS] array).
template <int BS>
void PackBlock(DType in, const void* src, int64_t ld, int64_t block, int64_t row0, int64_t rows, float* dst) {
  for (int64_t r = 0; r < rows; ++r) Widen(in, Offset(src, (row0 + r) * ld + block * BS, in), dst + r * BS, BS);
}

// Steps of k per product between loads and stores of the accumulators, where a product
// runs longer than one block (a panel, or a run of input blocks at blocks 64 and 128).
// 512 ran 2-3% faster than 128 at density 1 (2-core AMD EPYC; the loads and stores of a
// 6 x 64 register tile cost about 3% of 128 steps), and 1024 as fast as 512; the weights'
// [1024, 64] slice (256 KiB) stays in L2 while the row tiles pass over it. Where one
// product covers an item's whole depth, float32 outputs are summed where they lie (see
// SumsInPlace): that needs 1024 steps at the 1024-wide inputs of the benchmarks.
constexpr int64_t kProductDepth = 1024;

// Whether an item sums its float32 [rows, width] outputs where they lie (a whole output row
// apart) rather than in the thread's scratch, then copied: where its products are one product
// over the whole depth (`depth` steps of k), whose register tiles start from zero and
// store their sums once. The copy was 3-4% of fprop's time at density 1 (1024^3, float32,
// 2-core AMD EPYC); summed in place, fprop and bprop ran 1-3% faster at blocks 16 to 128
// (2-4% at 512^3). Where products add up (a longer depth), the accumulators load and store
// their rows a whole output row apart, and it was no faster.
inline bool SumsInPlace(DType out, int64_t depth) { return out == DType::kF32 && depth <= kProductDepth; }

// Rows [16 * item, 16 * item + 16) of `rows` rows of src [.., ld] from row `row0` on,
// widened to float32 into dst [rows, ld]: a work item of a widening pass.
inline void WidenRows(DType in, const void* src, int64_t ld, int64_t row0, int64_t rows, int64_t item, float* dst) {
  for (int64_t r = item * 16; r < Min(rows, item * 16 + 16); ++r) {
    Widen(in, Offset(src, (row0 + r) * ld, in), dst + r * ld, static_cast<int>(ld));
  }
}

// ---------------------------------------------------------------------------------
// Copies made once per call, by the items that first need them
// ---------------------------------------------------------------------------------
// A copy of the weights (a panel, or an output block's widened or transposed blocks) is
// made by the first items that need it, not in a pass of its own before the products: as
// a pass, the copy of a 1024^2 float32 weight whose blocks had left the caches took
// 0.29-0.44 ms (6-9% of the product; 0.08 ms for the same copy from cache). Made this way,
// all but the first copies overlap the other threads' products, which then read the copy
// from L2.

// Waits a moment for another thread (a spin: the wait is for work another item is doing).
inline void SpinPause(int64_t spins) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
  if (spins % 1024 == 1023) sched_yield();  // the copying thread may have been descheduled
}

// Runs copy(i) for every i in [0, count) once among the items that call it with the same
// two counters (zero at the start of the call): each claims `claim` of them at a time
// until none are left, then waits for those that other items claimed. No item waits on
// one that has not started copying, so this cannot deadlock.
template <typename Copy>
inline void CopyOnce(int32_t* claimed, int32_t* done, int32_t count, int32_t claim, const Copy& copy) {
  if (__atomic_load_n(done, __ATOMIC_ACQUIRE) >= count) return;
  for (int32_t i = __atomic_fetch_add(claimed, claim, __ATOMIC_RELAXED); i < count;
       i = __atomic_fetch_add(claimed, claim, __ATOMIC_RELAXED)) {
    const int32_t end = Min(i + claim, count);
    for (int32_t j = i; j < end; ++j) copy(j);
    __atomic_fetch_add(done, end - i, __ATOMIC_RELEASE);
  }
  for (int64_t spins = 0; __atomic_load_n(done, __ATOMIC_ACQUIRE) < count; ++spins) SpinPause(spins);
}

// ---------------------------------------------------------------------------------
// DSD: fprop and bprop
// ---------------------------------------------------------------------------------
// Per chunk of rows: (1) the lhs is widened into block-major [nin][rows][bs] (each
// input block read once, contiguous afterwards; skipped where ReadsLhsInPlace), (2) the
// items run: output block order[i / tiles] x row tile i % tiles, summing its slots'
// products in registers.

struct DsdJob {
  const DsdParams* p;
  DType in;
  DType out;
  bool transpose_w;
  int64_t nnz;
  int64_t row0, rows;     // the chunk of rows
  float* packed;          // [nin][rows][bs], or nullptr: the lhs read in place
  float* blocks;          // [cap][bs][bs] each entry's W(s) widened (transposed), or nullptr
  int32_t* copy_claimed;  // [nseg]: entries of output block j claimed for copying into blocks (atomic)
  int32_t* copy_done;     // [nseg]: entries of output block j copied (atomic)
  int64_t tiles;          // row tiles per output block in this chunk
  int64_t tile_rows;
};

// W(s) as float32 row-major [BS, BS] (w[s] or its transpose).
template <int BS>
const float* LoadBlock(const DsdJob& job, int64_t slot, float* scratch) {
  const void* src = Offset(job.p->w, slot * BS * BS, job.in);
  if (!job.transpose_w) {
    if (job.in == DType::kF32) return static_cast<const float*>(src);  // in place
    Widen(job.in, src, scratch, BS * BS);
    return scratch;
  }
  WidenTransposed<BS>(job.in, src, scratch);
  return scratch;
}

// Whether the items read float32 lhs rows where they are rather than from a block-major
// copy: where a block's row is 256 bytes or more (blocks 64 and 128). There the copy, one
// more pass over the lhs, cost more than it saved (fprop and bprop of 1024^3 at density
// 1, 8-10% faster in place at block 128; 12-20% at density 0.25), and rows read in place
// let a run of consecutive input blocks be one product (DsdItem). At block 64 the two
// measured alike block by block, and in runs in place 0.99 of XLA's dot against 0.95-0.98
// (density 1); at block 32 in place was 25% slower (rows of 128 bytes, 4 KiB apart).
template <int BS>
constexpr bool kReadsFloat32LhsInPlace = BS * sizeof(float) >= 256;

template <int BS>
bool ReadsLhsInPlace(DType in) {
  return kReadsFloat32LhsInPlace<BS> && in == DType::kF32;
}

// The slot of entry e of a segment, or -1 where it holds no block: padding (at or past
// nnz) or tables out of range (an entry is < cap).
inline int64_t SegmentSlot(const DsdParams& p, int64_t nnz, int64_t e) {
  if (e < 0 || e >= p.cap) return -1;
  const int64_t slot = p.seg_slots ? p.seg_slots[e] : e;
  if (slot < 0 || slot >= nnz) return -1;
  return p.in_block[slot] >= 0 && p.in_block[slot] < p.nin ? slot : -1;
}

// Entry e's W(s) widened (transposed) into the blocks.
template <int BS>
void CopyEntry(const DsdJob& job, int64_t e) {
  const int64_t slot = SegmentSlot(*job.p, job.nnz, e);
  if (slot >= 0) LoadBlock<BS>(job, slot, job.blocks + e * BS * BS);
}

template <int BS>
void DsdPackItem(void* arg, int64_t block) {
  const DsdJob& job = *static_cast<const DsdJob*>(arg);
  const int64_t fin = int64_t{job.p->nin} * BS;
  PackBlock<BS>(job.in, job.p->a, fin, block, job.row0, job.rows, job.packed + block * job.rows * BS);
}

template <int BS>
void DsdItem(void* arg, int64_t item) {
  const DsdJob& job = *static_cast<const DsdJob*>(arg);
  const DsdParams& p = *job.p;
  const int64_t seg = p.order[item / job.tiles];
  if (seg < 0 || seg >= p.nseg) return;                      // not a permutation: the handler's contract is broken
  const int64_t first = (item % job.tiles) * job.tile_rows;  // within the chunk
  const int64_t rows = Min(job.tile_rows, job.rows - first);
  if (rows <= 0) return;
  const int64_t begin = p.seg_ptr[seg], end = p.seg_ptr[seg + 1];
  if (job.blocks != nullptr) {
    CopyOnce(job.copy_claimed + seg, job.copy_done + seg, static_cast<int32_t>(end - begin), BS >= 64 ? 1 : 4,
             [&](int32_t i) { CopyEntry<BS>(job, begin + i); });
  }
  Scratch& s = ThreadScratch();
  const int64_t fout = int64_t{p.nseg} * BS;
  // In place where the segment is one run (at most a few, where it has gaps).
  const bool in_place = job.packed == nullptr && SumsInPlace(job.out, (end - begin) * BS);
  float* C = in_place ? static_cast<float*>(p.out) + (job.row0 + first) * fout + seg * BS : s.acc;
  const int64_t ldc = in_place ? fout : BS;
  bool zero = true;  // the first product sets C
  for (int64_t e = begin; e < end; ++e) {
    const int64_t slot = SegmentSlot(p, job.nnz, e);
    if (slot < 0) continue;
    const int64_t block = p.in_block[slot];
    const float* w = job.blocks ? job.blocks + e * BS * BS : LoadBlock<BS>(job, slot, s.w);
    if constexpr (kReadsFloat32LhsInPlace<BS>) {
      if (job.packed == nullptr) {  // float32 rows read where they are
        // A run of entries on consecutive input blocks whose weights lie one after another
        // (consecutive entries of the widened copy, or consecutive slots read in place) is
        // one product over its whole depth: the accumulators are loaded and stored once
        // per run, not per block (fprop at block 128, density 1: 0.92-0.95 of XLA's dot
        // block by block, 0.99-1.02 in runs). At most kProductDepth steps of k.
        const bool weights_in_place = job.blocks == nullptr && job.in == DType::kF32 && !job.transpose_w;
        int64_t run = 1;
        while (e + run < end && (run + 1) * BS <= kProductDepth) {
          const int64_t next = SegmentSlot(p, job.nnz, e + run);
          if (next < 0 || p.in_block[next] != block + run) break;
          if (job.blocks == nullptr && !(weights_in_place && next == slot + run)) break;
          ++run;
        }
        const int64_t fin = int64_t{p.nin} * BS;
        const float* a = static_cast<const float*>(p.a) + (job.row0 + first) * fin + block * BS;
        Gemm<BS>(rows, run * BS, a, fin, 1, w, BS, C, ldc, zero);
        zero = false;
        e += run - 1;
        continue;
      }
    }
    Gemm<BS>(rows, BS, job.packed + (block * job.rows + first) * BS, BS, 1, w, BS, C, ldc, zero);
    zero = false;
  }
  if (zero) {  // no products: zeros
    for (int64_t r = 0; r < rows; ++r) std::memset(C + r * ldc, 0, sizeof(float) * BS);
  }
  if (in_place) return;
  for (int64_t r = 0; r < rows; ++r) {
    Narrow(s.acc + r * BS, job.out, Offset(p.out, (job.row0 + first + r) * fout + seg * BS, job.out), BS);
  }
}

// Row tiles per output block: enough that the longest block splits over the workers
// (load balance), few enough that each widened weight block serves many rows, and
// each tile's accumulator stays in L1 (at most 4096 floats).
// `longest` and `total` are the largest and the summed segment lengths.
int64_t DsdTiles(int64_t longest, int64_t total, int64_t rows, int bs, int workers) {
  const int64_t for_cache = CeilDiv(rows, Max(8, 4096 / bs));
  const int64_t for_balance = total > 0 ? CeilDiv(longest * 4 * workers, total) : 1;
  return Max(1, Min(CeilDiv(rows, 8), Max(for_cache, for_balance)));
}

// fprop/bprop on column panels, where the layout is dense enough (below).
template <int BS>
bool RunDsdPanels(const DsdJob& dsd, const Parallel& par);

template <int BS>
bool RunDsdBlock(DsdJob& job, const Parallel& par) {
  if (RunDsdPanels<BS>(job, par)) return true;
  const DsdParams& p = *job.p;
  const int64_t chunk = Max(1, kPackFloats / (int64_t{p.nin} * BS + 1));
  float* packed = nullptr;
  if (!ReadsLhsInPlace<BS>(job.in)) {
    packed = CallerBuffer(0).Get(Min(chunk, p.n) * Max(1, p.nin) * BS);
    if (packed == nullptr) return false;
  }
  // Weights that are not float32 [bs, bs] as stored are widened (transposed) once per
  // call, when that fits the budget, rather than once per row tile: each output block's
  // by the items that first need them (CopyOnce), indexed by entry (an entry is < cap),
  // so that an output block's weights lie in the order its items read them.
  job.blocks = nullptr;
  const int64_t block_floats = int64_t{p.cap} * BS * BS;
  if ((job.in != DType::kF32 || job.transpose_w) && job.nnz > 0 && block_floats <= kPackWeightFloats) {
    job.blocks = CallerBuffer(1).Get(block_floats);
    auto* counters = reinterpret_cast<int32_t*>(CallerBuffer(3).Get(2 * int64_t{p.nseg}));
    if (job.blocks == nullptr || counters == nullptr) {
      job.blocks = nullptr;  // each row tile widens the blocks it uses
    } else {
      for (int64_t j = 0; j < 2 * int64_t{p.nseg}; ++j) counters[j] = 0;
      job.copy_claimed = counters;
      job.copy_done = counters + p.nseg;
    }
  }
  int64_t longest = 0, total = 0;
  for (int j = 0; j < p.nseg; ++j) {
    const int64_t len = p.seg_ptr[j + 1] - p.seg_ptr[j];
    longest = Max(longest, len);
    total += len;
  }
  for (int64_t row0 = 0; row0 < p.n; row0 += chunk) {
    job.row0 = row0;
    job.rows = Min(chunk, p.n - row0);
    job.packed = packed;
    if (packed != nullptr) par.for_each(par.ctx, p.nin, &DsdPackItem<BS>, &job);
    // Tiles of whole register tiles: a tail row runs at half the FMA rate (its few
    // accumulators wait on the FMA latency), 6% of block 128's time at 32 rows a tile.
    constexpr int64_t kR = TileShape<BS>::kRows;
    job.tile_rows = CeilDiv(CeilDiv(job.rows, DsdTiles(longest, total, job.rows, BS, par.workers)), kR) * kR;
    job.tiles = CeilDiv(job.rows, job.tile_rows);
    par.for_each(par.ctx, job.tiles * p.nseg, &DsdItem<BS>, &job);
  }
  return true;
}

// ---------------------------------------------------------------------------------
// DSD on column panels: blocks of 8 to 32 in dense layouts (AVX-512)
// ---------------------------------------------------------------------------------
// A block of 8 to 32 columns makes a narrow register tile (at block 8, half a 512-bit
// vector a row), and each slot's product is only BS steps of k between loads and stores
// of the accumulators: at density 1 the block kernels ran at 0.40 (block 8), 0.79 (16)
// and 0.95 (32) of XLA's float32 dot (1024^3, 2-core AVX-512 machine). Where the layout
// is dense enough, G = 128 / BS neighbouring output blocks form one 128-column panel, and
// each item is a tile of rows times a panel. The lhs is read as rows (in place when
// float32, else from a widened row-major copy). The weights:
//   - float32 fprop reads them where they lie (InPlacePanel): the register tile loads a
//     row of each of its 64 / BS output blocks (zeros for those the panel lacks) and sums
//     over all the panel's input blocks with its accumulators in registers. On the AMD
//     EPYC at density 1: 0.98-1.03 of XLA's dot at 256 and 1024 rows, against 0.90-1.0
//     for the copied panels below (their copy is one more pass over the weights).
//   - the others (16-bit weights, widened; bprop's, transposed) are copied once per call
//     into [the panel's input blocks][BS][128] (zeros for the blocks it lacks; by the
//     items that first need the panel, CopyOnce), one product per run of consecutive input
//     blocks (a run's panel rows are contiguous, and so are its lhs columns). At density 1
//     that ran at 0.98-1.03 of XLA's dot on the AMX Xeon, 0.94-1.0 on the AMD EPYC.
//     bprop could skip its copy as dot products instead (each output = a dy row's BS
//     floats . a row of W(s), both contiguous, partial sums along j in the accumulators,
//     reduced once at the end), but a bprop output block's slots are a stored column
//     apart (32 KiB at block 8 in a 1024^2 weight), and their rows alias in L1 and L2:
//     every row tile streamed them again from L3. Measured on the AMD EPYC, 1024^3,
//     density 1: 1.4-1.8x slower than this copy, at every block size. In a standalone
//     test at block 8, one core ran 204 GFLOP/s with the blocks in their stored order
//     and 259 with the same blocks stored row by row; summing over chunks of 8 to 32
//     slots (partial sums kept between chunks) was slower still.
// 64-column panels ran 5-10% slower than 128. With AVX2's narrower tiles the panels
// gained nothing but at block 8, so they are the AVX-512 kernels' only. Blocks of 64 and
// 128 make the wide tile themselves, and read runs of input blocks in one product
// (DsdItem): two-block panels at block 64 measured 1-3% slower than that.

constexpr int kPanel = 128;  // columns of a panel

// Copied panels are held a few at a time (at least kPanelRing), each copy
// reused by a later panel once the items reading it are done, rather than all at once:
// the copies then stay in the caches, and a 4096^2 weight's take 8 MB, not 64. bprop at
// density 1 (1024 rows), of XLA's dot, all at once against a ring of 4, six runs each in
// turn on the 2-core AMD EPYC: W 4096^2 0.59-1.03 against 0.83-1.01 (the whole copy leaves
// the caches), W 1024^2 alike (0.92-1.03 against 0.98-1.10).
constexpr int64_t kPanelRing = 4;

// Least fraction of a panel's multiply-adds that must fall on present blocks: below it the
// block kernels are the faster (a missing block costs a panel as much as a present one).
// Measured against the block kernels at densities 1, 0.75, 0.5 and 0.3: the panel's rate
// is about 2.4x block 8's, 1.25x block 16's and 1.08x block 32's.
template <int BS>
constexpr double kPanelMinFill = BS == 8    ? 0.45
                                 : BS == 16 ? 0.8
                                            : 0.92;

// Float32 fprop's panels read in place need this many rows: with fewer, the 6-row tile's
// tails cost more than the wider tile saves. At 16 rows of a 1024^2 weight at density 1,
// the panels ran 0.88 (block 16) and 0.97-1.2 (32) of XLA's dot against the block kernels'
// 0.87-1.02 and 1.19-1.3; from 64 rows they were 5-20% faster; at block 8 from 16 rows
// (0.69-0.77 against 0.43-0.51).
template <int BS>
constexpr int64_t kInPlacePanelRows = BS == 8 ? 1 : 64;

struct PanelJob {
  const DsdParams* p;
  DType in;
  DType out;
  bool transpose_w;
  int group;                   // G: output blocks per panel
  int64_t groups;              // panels: ceil(nseg / G)
  const int32_t* entry_ptr;    // [groups + 1]: panel g's input blocks are entries entry_ptr[g]:entry_ptr[g+1]
  const int32_t* entry_block;  // [entries]: each entry's input block, ascending within a panel
  const int32_t* entry_slots;  // [entries * G]: the slot of (entry, output block g * G + jj), -1 for none
  int32_t* pack_claimed;       // [groups]: entries of panel g claimed for copying (atomic)
  int32_t* pack_done;          // [groups]: entries of panel g copied (atomic)
  int32_t* finished;           // [groups]: items of panel g done (atomic)
  float* panels;               // [ring][copy_floats]: the copies (PanelCopy), or nullptr: read in place
  int64_t ring;                // copies held at once (kPanelRing)
  int64_t copy_floats;         // floats per copy: the most entries of a panel * BS * kPanel
  const float* lhs;            // rows [row0, row0 + rows) as float32 [rows, nin * BS] (lhs row r at r - row0)
  float* widened;              // the widened copy of those rows (16-bit lhs), else nullptr
  int64_t row0, rows;
  int64_t tiles, tile_rows;
};

// Entry e's BS rows of its panel: each output block's weights (transposed for bprop), or zeros.
template <int BS>
void PackEntry(const PanelJob& job, int64_t e, float* rows) {
  constexpr int G = kPanel / BS;
  const void* blocks[G];  // each output block's weights, or nullptr: zeros
  for (int jj = 0; jj < G; ++jj) {
    const int32_t slot = job.entry_slots[e * G + jj];  // job.group == G
    blocks[jj] = slot < 0 ? nullptr : Offset(job.p->w, int64_t{slot} * BS * BS, job.in);
  }
  if (job.transpose_w) {  // each block transposed straight into its columns of the panel
    for (int jj = 0; jj < G; ++jj) {
      if (blocks[jj] != nullptr) {
        WidenTransposed<BS>(job.in, blocks[jj], rows + jj * BS, kPanel);
      } else {
        for (int i = 0; i < BS; ++i) std::memset(rows + i * kPanel + jj * BS, 0, sizeof(float) * BS);
      }
    }
    return;
  }
  // Row by row of the panel, so that its rows are written in order (block 8: 32 bytes
  // from each of 16 blocks make one row of 512).
  for (int i = 0; i < BS; ++i) {
    float* row = rows + i * kPanel;
    for (int jj = 0; jj < G; ++jj) {
      if (blocks[jj] != nullptr) {
        Widen(job.in, Offset(blocks[jj], i * BS, job.in), row + jj * BS, BS);
      } else {
        std::memset(row + jj * BS, 0, sizeof(float) * BS);
      }
    }
  }
}

// Where panel g's copy lies: [its entries][BS][kPanel].
inline float* PanelCopy(const PanelJob& job, int64_t g) { return job.panels + (g % job.ring) * job.copy_floats; }

// Panel g, copied by the items that first need it, once the items of the panel whose copy
// it replaces (g - ring) are done: those were all claimed before this item (items are
// claimed in order) and wait only on earlier panels, so this cannot deadlock.
template <int BS>
void PackPanel(const PanelJob& job, int64_t g) {
  if (g >= job.ring) {
    const int32_t* done = job.finished + (g - job.ring);
    for (int64_t spins = 0; __atomic_load_n(done, __ATOMIC_ACQUIRE) < job.tiles; ++spins) SpinPause(spins);
  }
  const int32_t first = job.entry_ptr[g];
  float* copy = PanelCopy(job, g);
  CopyOnce(job.pack_claimed + g, job.pack_done + g, job.entry_ptr[g + 1] - first, 4,  // 8 KiB an entry at float32
           [&](int32_t i) { PackEntry<BS>(job, first + i, copy + int64_t{i} * BS * kPanel); });
}

// Rows of the chunk widened to float32, 16 rows an item.
void PanelWidenItem(void* arg, int64_t item) {
  const PanelJob& job = *static_cast<const PanelJob*>(arg);
  WidenRows(job.in, job.p->a, int64_t{job.p->nin} * job.p->bs, job.row0, job.rows, item, job.widened);
}

// Float32 fprop needs its weights neither widened nor transposed, so there the panel is
// not copied: the register tile reads each output block's rows where they lie (64
// columns of a panel are 64 / BS blocks side by side) and sums over all of the panel's
// entries with its accumulators in registers, loaded and stored once per product. A
// block the panel lacks reads as zeros (kZeroBlock).
#if defined(__AVX512F__)
alignas(64) const float kZeroBlock[32 * 32] = {};

// Row k of 16 columns v * 16 ... of the blocks b side by side: one block's (BS >= 16) or
// two blocks' (BS = 8).
template <int BS>
__attribute__((always_inline)) inline V16 PanelRow(const float* const* b, int v, int k) {
  if constexpr (BS >= 16) {
    return *reinterpret_cast<const V16u*>(b[v * 16 / BS] + k * BS + v * 16 % BS);
  } else {
    const __m512d lo = _mm512_castpd256_pd512(_mm256_loadu_pd(reinterpret_cast<const double*>(b[2 * v] + k * BS)));
    const __m256d hi = _mm256_loadu_pd(reinterpret_cast<const double*>(b[2 * v + 1] + k * BS));
    return reinterpret_cast<V16>(_mm512_insertf64x4(lo, hi, 1));
  }
}

// C[R][64] += sum over the entries e in [e0, e1) of panel g of A[R, block(e) * BS + k] @
// row k of the 64 / BS output blocks' weights from g * G + half * 64 / BS on (k < BS);
// = where `zero`.
template <int BS, int R>
inline void InPlaceTile(const PanelJob& job, int64_t g, int64_t e0, int64_t e1, int half, const float* A, int64_t a_row,
                        float* C, int64_t ldc, bool zero) {
  constexpr int G = kPanel / BS, kBlocks = 64 / BS;
  const float* w = static_cast<const float*>(job.p->w);
  V16 c[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) c[r][v] = zero ? V16{} : *reinterpret_cast<const V16u*>(C + r * ldc + v * 16);
  for (int64_t e = e0; e < e1; ++e) {
    const float* b[kBlocks];
    const int32_t* slots = job.entry_slots + e * G + half * kBlocks;
#pragma GCC unroll 8
    for (int q = 0; q < kBlocks; ++q) b[q] = slots[q] < 0 ? kZeroBlock : w + int64_t{slots[q]} * BS * BS;
    const float* a = A + int64_t{job.entry_block[e]} * BS;
    // Rows 3 to 5 from a second base, each row's address a base plus a_row times 4 or 8
    // bytes. With a_row itself, GCC hoisted out of this loop the offset of every row and
    // k of block 8's unrolled loop, 48 of them, and reloaded each from the stack: hidden
    // from it (the asm), block 8's items ran 1-3% faster (1024^3, density 1, one and two
    // cores of the AMD EPYC; blocks 16 and 32 alike either way). A tile of 3 rows or fewer
    // has one base: a + 3 * stride would point past the lhs there.
    int64_t stride = a_row;
    asm("" : "+r"(stride));
    const float* rows[2] = {a, R > 3 ? a + 3 * stride : a};
    // GCC unrolls block 8's loop whole (the fastest) and not those of 16 and 32 at 6 rows
    // (unrolled whole they spilled the accumulators: 0.55-0.6 of XLA's dot).
#pragma GCC unroll 8
    for (int k = 0; k < BS; ++k) {
      V16 bv[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) bv[v] = PanelRow<BS>(b, v, k);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const V16 ar = Splat<V16, 16>(rows[r / 3] + r % 3 * stride + k);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) c[r][v] += ar * bv[v];
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) *reinterpret_cast<V16u*>(C + r * ldc + v * 16) = c[r][v];
}

// C[rows, 128] (rows ldc apart) = panel g's product, its weights read in place.
template <int BS>
void InPlacePanel(const PanelJob& job, int64_t g, int64_t rows, const float* A, int64_t a_row, float* C, int64_t ldc) {
  constexpr int R = TileShape<kPanel>::kRows, kBlocks = 64 / BS;
  // kProductDepth steps of k at a time, so that their weights (512 KiB) stay in L2 while
  // the row tiles pass over them. Over the whole depth, block 8 fprop at K = 8192 ran at
  // 0.74 of XLA's dot (0.96-0.99 so); at 512 steps, 1024 cubed lost 2-3% at block 8.
  constexpr int64_t kEntries = kProductDepth / BS;
  for (int64_t e0 = job.entry_ptr[g]; e0 < job.entry_ptr[g + 1]; e0 += kEntries) {
    const int64_t e1 = Min(e0 + kEntries, job.entry_ptr[g + 1]);
    for (int half = 0; half < 2; ++half) {
      if (g * job.group + half * kBlocks >= job.p->nseg) break;  // no output blocks there
      const bool zero = e0 == job.entry_ptr[g];                  // the first pass sets C
      float* Ch = C + half * 64;
      int64_t r = 0;
      for (; r + R <= rows; r += R) {
        InPlaceTile<BS, R>(job, g, e0, e1, half, A + r * a_row, a_row, Ch + r * ldc, ldc, zero);
      }
      for (; r + R / 2 <= rows; r += R / 2) {
        InPlaceTile<BS, R / 2>(job, g, e0, e1, half, A + r * a_row, a_row, Ch + r * ldc, ldc, zero);
      }
      for (; r < rows; ++r) InPlaceTile<BS, 1>(job, g, e0, e1, half, A + r * a_row, a_row, Ch + r * ldc, ldc, zero);
    }
  }
}
#else
template <int BS>
void InPlacePanel(const PanelJob&, int64_t, int64_t, const float*, int64_t, float*, int64_t) {}
#endif
// C[rows, 128] (rows ldc apart) = panel g's product, from its copy (made by the items that
// first need it).
template <int BS>
void CopiedPanel(const PanelJob& job, int64_t g, int64_t rows, const float* a, int64_t fin, float* C, int64_t ldc) {
  PackPanel<BS>(job, g);
  for (int64_t e = job.entry_ptr[g]; e < job.entry_ptr[g + 1];) {
    int64_t end = e + 1;  // the run of consecutive input blocks starting at entry e
    while (end < job.entry_ptr[g + 1] && job.entry_block[end] == job.entry_block[end - 1] + 1) ++end;
    const int64_t depth = (end - e) * BS;
    const float* A = a + int64_t{job.entry_block[e]} * BS;
    const float* B = PanelCopy(job, g) + (e - job.entry_ptr[g]) * BS * kPanel;
    for (int64_t k0 = 0; k0 < depth; k0 += kProductDepth) {
      const bool zero = e == job.entry_ptr[g] && k0 == 0;  // the first product sets C
      Gemm<kPanel>(rows, Min(kProductDepth, depth - k0), A + k0, fin, 1, B + k0 * kPanel, kPanel, C, ldc, zero);
    }
    e = end;
  }
}

template <int BS>
void PanelItem(void* arg, int64_t item) {
  const PanelJob& job = *static_cast<const PanelJob*>(arg);
  const DsdParams& p = *job.p;
  const int64_t g = item / job.tiles;
  const int64_t first = (item % job.tiles) * job.tile_rows;  // within the chunk
  const int64_t rows = Min(job.tile_rows, job.rows - first);
  const int64_t fin = int64_t{p.nin} * BS;
  const int64_t fout = int64_t{p.nseg} * BS;
  const int64_t width = (Min(p.nseg, (g + 1) * job.group) - g * job.group) * BS;
  // A whole panel in place (SumsInPlace). Not at block 8 read in place: there it ran 2%
  // slower than summed in the scratch (fprop, 1024^3, density 1), and since InPlaceTile's
  // row addresses were fixed within 1% either way (two cores +1.1%, one core -0.9%, medians
  // of 8-10 processes), so no reason to change. An item past the chunk's rows (rows <= 0)
  // writes nothing, and points nowhere past the output.
  const bool in_place = rows > 0 && width == kPanel && !(BS == 8 && job.panels == nullptr) &&
                        SumsInPlace(job.out, (job.entry_ptr[g + 1] - job.entry_ptr[g]) * BS);
  float* C =
      in_place ? static_cast<float*>(p.out) + (job.row0 + first) * fout + g * job.group * BS : ThreadScratch().acc;
  const int64_t ldc = in_place ? fout : kPanel;
  if (rows > 0) {
    if (job.entry_ptr[g] == job.entry_ptr[g + 1]) {  // no products: zeros
      for (int64_t r = 0; r < rows; ++r) std::memset(C + r * ldc, 0, sizeof(float) * width);
    } else if (job.panels == nullptr) {
      InPlacePanel<BS>(job, g, rows, job.lhs + first * fin, fin, C, ldc);
    } else {
      CopiedPanel<BS>(job, g, rows, job.lhs + first * fin, fin, C, ldc);
    }
  }
  // Done with the copy (counted whatever its rows: a later panel waits on every item).
  if (job.panels != nullptr) __atomic_fetch_add(job.finished + g, 1, __ATOMIC_RELEASE);
  if (in_place) return;
  for (int64_t r = 0; r < rows; ++r) {
    Narrow(C + r * kPanel, job.out, Offset(p.out, (job.row0 + first + r) * fout + g * job.group * BS, job.out),
           static_cast<int>(width));
  }
}

// The panels' entries: for each panel, the input blocks any of its output blocks reads,
// ascending, and the slot of each (entry, output block). Returns the number of entries, or
// -1 where panels do not apply: too few multiply-adds on present blocks (kPanelMinFill), a
// cell named by two slots (the block kernels sum both), or no memory.
template <int BS>
int64_t PlanPanels(const DsdParams& p, int64_t nnz, PanelJob* job) {
  constexpr int G = kPanel / BS;
  const int64_t groups = CeilDiv(p.nseg, G);
  const int64_t most = groups * p.nin;  // entries at most
  // int32 tables in one caller buffer: entry_ptr, entry_block, entry_slots, and three
  // counters per panel (the copy's two, its items done).
  const int64_t ints = (groups + 1) + most + most * G + 3 * groups;
  auto* base = reinterpret_cast<int32_t*>(CallerBuffer(3).Get(ints));
  if (base == nullptr) return -1;
  int32_t* entry_ptr = base;
  int32_t* entry_block = entry_ptr + groups + 1;
  int32_t* entry_slots = entry_block + most;
  int32_t* pack_counters = entry_slots + most * G;
  for (int64_t i = 0; i < 3 * groups; ++i) pack_counters[i] = 0;
  // The fill needs used * BS >= kPanelMinFill * entries * kPanel, and used <= nnz: past
  // this many entries it cannot be reached, and the plan stops (a sparse layout's costs
  // a fraction of its product's time at few rows).
  const double most_entries = static_cast<double>(nnz) * BS / (kPanelMinFill<BS> * kPanel);
  int64_t entries = 0, used = 0;
  for (int64_t g = 0; g < groups; ++g) {
    entry_ptr[g] = static_cast<int32_t>(entries);
    // The panel's grid, a row per input block (cell jj: the slot of output block g * G + jj,
    // or -1), laid where its entries go, then its empty rows dropped: one pass over the
    // slots (a pass to mark the input blocks, then one to fill the cells, took 55 us a
    // call at block 8, 1024^2). Its nin rows fit: entries <= g * nin here.
    int32_t* grid = entry_slots + entries * G;
    for (int64_t i = 0; i < int64_t{p.nin} * G; ++i) grid[i] = -1;
    const int64_t last = Min(p.nseg, (g + 1) * G);
    for (int64_t j = g * G; j < last; ++j) {
      for (int64_t e = p.seg_ptr[j]; e < p.seg_ptr[j + 1]; ++e) {
        const int64_t slot = SegmentSlot(p, nnz, e);
        if (slot < 0) continue;
        int32_t& cell = grid[int64_t{p.in_block[slot]} * G + (j - g * G)];
        if (cell >= 0) return -1;
        cell = static_cast<int32_t>(slot);
        ++used;
      }
    }
    for (int b = 0; b < p.nin; ++b) {  // rows moved down over the empty ones (never up)
      const int32_t* row = grid + int64_t{b} * G;
      bool any = false;
      for (int jj = 0; jj < G; ++jj) any |= row[jj] >= 0;
      if (!any) continue;
      int32_t* to = entry_slots + entries * G;
      if (to != row) {
        for (int jj = 0; jj < G; ++jj) to[jj] = row[jj];
      }
      entry_block[entries] = b;
      if (++entries > most_entries) return -1;
    }
  }
  entry_ptr[groups] = static_cast<int32_t>(entries);
  if (entries == 0 || used * BS < kPanelMinFill<BS> * entries * kPanel) return -1;
  job->group = G;
  job->groups = groups;
  job->entry_ptr = entry_ptr;
  job->entry_block = entry_block;
  job->entry_slots = entry_slots;
  job->pack_claimed = pack_counters;
  job->pack_done = pack_counters + groups;
  job->finished = pack_counters + 2 * groups;
  return entries;
}

// fprop/bprop on panels; false where they do not apply (nothing written then).
template <int BS>
bool RunDsdPanels(const DsdJob& dsd, const Parallel& par) {
  if constexpr (BS >= 64 || JBS_CPU_LANES != 16) {
    return false;
  } else {
    const DsdParams& p = *dsd.p;
    const bool in_place = dsd.in == DType::kF32 && !dsd.transpose_w;  // else widened or transposed: copied
    if (in_place && p.n < kInPlacePanelRows<BS>) return false;
    PanelJob job{};
    job.p = &p;
    job.in = dsd.in;
    job.out = dsd.out;
    job.transpose_w = dsd.transpose_w;
    const int64_t entries = PlanPanels<BS>(p, dsd.nnz, &job);
    if (entries < 0) return false;
    const int64_t fin = int64_t{p.nin} * BS;
    const int64_t chunk = Max(1, kPackFloats / (fin + 1));
    // Tiles of whole register tiles, at most 60 rows (the accumulators stay in L1), and
    // enough items for 4 per worker.
    constexpr int64_t kR = TileShape<kPanel>::kRows;
    const auto set_tiles = [&](int64_t rows) {
      const int64_t tiles = Max(CeilDiv(rows, 10 * kR), CeilDiv(4 * par.workers, job.groups));
      job.tile_rows = CeilDiv(CeilDiv(rows, tiles), kR) * kR;
      job.tiles = CeilDiv(rows, job.tile_rows);
    };
    if (!in_place) {
      int64_t longest = 0;  // entries of the longest panel
      for (int64_t g = 0; g < job.groups; ++g) longest = Max(longest, job.entry_ptr[g + 1] - job.entry_ptr[g]);
      // Room for the panels the workers are on at once (a panel's items are neighbours),
      // and two more.
      set_tiles(Min(chunk, p.n));
      job.ring = Min(job.groups, Max(kPanelRing, 2 + CeilDiv(par.workers, job.tiles)));
      job.copy_floats = longest * BS * kPanel;
      if (job.ring * job.copy_floats > kPackWeightFloats) return false;
      job.panels = CallerBuffer(1).Get(job.ring * job.copy_floats);
      if (job.panels == nullptr) return false;
    }
    if (job.in != DType::kF32) job.widened = CallerBuffer(0).Get(Min(chunk, p.n) * fin);
    if (job.in != DType::kF32 && job.widened == nullptr) return false;
    for (int64_t row0 = 0; row0 < p.n; row0 += chunk) {
      job.row0 = row0;
      job.rows = Min(chunk, p.n - row0);
      if (row0 > 0 && job.panels != nullptr && job.ring < job.groups) {  // copies replaced: made again
        for (int64_t i = 0; i < 3 * job.groups; ++i) job.pack_claimed[i] = 0;
      }
      if (job.widened != nullptr) {
        par.for_each(par.ctx, CeilDiv(job.rows, 16), &PanelWidenItem, &job);
        job.lhs = job.widened;
      } else {
        job.lhs = static_cast<const float*>(p.a) + row0 * fin;
      }
      set_tiles(job.rows);
      par.for_each(par.ctx, job.groups * job.tiles, &PanelItem<BS>, &job);
    }
    return true;
  }
}

// ---------------------------------------------------------------------------------
// SDD: updat
// ---------------------------------------------------------------------------------
// Per chunk of rows: (1) x and dy are widened into block-major [cb][rows][bs] and
// [kb][rows][bs], (2) one item per slot adds x_block^T @ dy_block to its accumulator,
// k-blocked so that both operand panels stay in L1. Accumulators: dw itself when it is
// float32, a per-thread block when there is one chunk, else a float32 [cap, bs, bs].

// The chunk of rows an updat is summing: rows [row0, row0 + rows) of n, in chunks of
// `chunk` rows, and whether it is the first or the last.
struct SddChunk {
  int64_t row0, rows;
  bool first, last;
  void Select(int64_t n, int64_t chunk, int64_t chunks, int64_t c) {
    row0 = c * chunk;
    rows = Max(0, Min(chunk, n - row0));
    first = c == 0;
    last = c == chunks - 1;
  }
};

// Whether updat's slot s holds a block: a slot in use (below nnz) whose tables name a
// block inside the grid. The others are zeros in dw.
inline bool SddSlotHoldsBlock(const SddParams& p, int64_t nnz, int64_t s) {
  return s < nnz && p.block_rows[s] >= 0 && p.block_rows[s] < p.cb && p.block_cols[s] >= 0 && p.block_cols[s] < p.kb;
}

struct SddJob : SddChunk {
  const SddParams* p;
  DType in;
  DType out;
  int64_t nnz;
  float* px;            // [cb][rows][bs]
  float* pdy;           // [kb][rows][bs]
  float* accumulators;  // [cap, bs, bs] float32 (dw itself, or scratch), or nullptr
};

template <int BS>
void SddPackItem(void* arg, int64_t item) {
  const SddJob& job = *static_cast<const SddJob*>(arg);
  const SddParams& p = *job.p;
  if (item < p.cb) {
    PackBlock<BS>(job.in, p.x, int64_t{p.cb} * BS, item, job.row0, job.rows, job.px + item * job.rows * BS);
  } else {
    const int64_t block = item - p.cb;
    PackBlock<BS>(job.in, p.dy, int64_t{p.kb} * BS, block, job.row0, job.rows, job.pdy + block * job.rows * BS);
  }
}

template <int BS>
void SddItem(void* arg, int64_t slot) {
  const SddJob& job = *static_cast<const SddJob*>(arg);
  const SddParams& p = *job.p;
  const bool valid = SddSlotHoldsBlock(p, job.nnz, slot);
  const int64_t row_block = valid ? p.block_rows[slot] : -1;
  const int64_t col_block = valid ? p.block_cols[slot] : -1;
  float* acc = job.accumulators ? job.accumulators + slot * BS * BS : ThreadScratch().acc;
  if (job.first) std::memset(acc, 0, sizeof(float) * BS * BS);  // padding stays zero
  if (valid) {
    const float* x = job.px + row_block * job.rows * BS;
    const float* dy = job.pdy + col_block * job.rows * BS;
    const int64_t panel = Max(16, 4096 / BS);  // rows per k-block: 2 panels of <= 16 KiB
    for (int64_t k0 = 0; k0 < job.rows; k0 += panel) {
      Gemm<BS>(BS, Min(panel, job.rows - k0), x + k0 * BS, 1, BS, dy + k0 * BS, BS, acc, BS);
    }
  }
  if (job.last && job.out != DType::kF32) Narrow(acc, job.out, Offset(p.dw, slot * BS * BS, job.out), BS * BS);
}

// updat on panels, where the layout is dense enough (below).
template <int BS>
bool RunSddPanels(const SddJob& sdd, const Parallel& par);

template <int BS>
bool RunSddBlock(SddJob& job, const Parallel& par) {
  if (RunSddPanels<BS>(job, par)) return true;
  const SddParams& p = *job.p;
  const int64_t chunk = Max(1, kPackFloats / ((int64_t{p.cb} + p.kb) * BS + 1));
  const int64_t chunks = Max(1, CeilDiv(p.n, chunk));
  const int64_t rows_max = Min(chunk, Max(1, p.n));
  job.px = CallerBuffer(0).Get(rows_max * Max(1, p.cb) * BS);
  job.pdy = CallerBuffer(1).Get(rows_max * Max(1, p.kb) * BS);
  if (job.px == nullptr || job.pdy == nullptr) return false;
  bool ok;
  job.accumulators = SddAccumulators(p, job.out == DType::kF32, chunks, &ok);
  if (!ok) return false;
  for (int64_t c = 0; c < chunks; ++c) {
    job.Select(p.n, chunk, chunks, c);
    if (job.rows > 0) par.for_each(par.ctx, int64_t{p.cb} + p.kb, &SddPackItem<BS>, &job);
    // One item per slot: every slot is the same work. Consecutive slots mostly share
    // an output block column (storage order), so neighbouring items reuse dy.
    par.for_each(par.ctx, p.cap, &SddItem<BS>, &job);
  }
  return true;
}

// ---------------------------------------------------------------------------------
// SDD on panels: blocks 8 and 16 in dense layouts (AVX-512)
// ---------------------------------------------------------------------------------
// At block 8 each slot's product X_s^T @ DY_s is an 8 x 8 register tile of half vectors:
// at density 1 the slot kernels ran at 0.54 of XLA's x.T @ dy (1024^3 float32, 2-core
// AMD EPYC), against 0.98-1.02 at block 16 and 1.1-1.2 at blocks 32 to 128. Where the layout is dense enough,
// each item is one 128 x 128 tile of dW that holds blocks, a pair (row panel P, column
// panel Q) of G = 128 / BS block rows and columns: the whole tile X[:, P]^T @ DY[:, Q] in
// one product (the present blocks and the missing ones alike), then each present block
// copied out of it into its slot. x and dy are read as rows: in place when float32,
// else from widened row-major copies of a chunk of rows; each product copies its slice
// of x (SddPanelItem).

struct SddPanelJob : SddChunk {
  const SddParams* p;
  DType in;
  DType out;
  int64_t nnz;
  int64_t col_panels;        // CP = K / 128
  const int32_t* tile_cell;  // [tiles]: P * CP + Q of each tile that holds a block
  const int32_t* tile_ptr;   // [tiles + 1]: tile t's slots are tile_slots[tile_ptr[t]:tile_ptr[t + 1]]
  const int32_t* tile_slots;
  int64_t tiles;
  const float* x;   // rows [row0, row0 + rows) as float32 [rows, C]
  const float* dy;  // the same rows of dy, [rows, K]
  float* wide_x;    // widened copies of those rows (16-bit inputs), else nullptr
  float* wide_dy;
  float* accumulators;  // [cap, bs, bs] float32 (dw itself, or scratch), or nullptr
};

// Least fraction of the tiles' multiply-adds that must fall on present blocks: at density 1
// the tiles ran about 1.9x faster than the slot kernels at block 8 (5.6-5.8 ms against
// 10.6-10.9 ms), 1.08x at block 16 (and 0.93x at block 32, which keeps its slots).
template <int BS>
constexpr double kSddPanelMinFill = BS == 8 ? 0.45 : 0.93;

// Rows (steps of k) per product between loads and stores of the accumulators: 256 ran
// 4-10% faster than 512 here (1.05-1.07 of XLA's x.T @ dy against 0.93-1.01, in turn), B's
// [256, 64] slice and A's 256 rows then stay in L2 with room to spare.
constexpr int64_t kSddPanelDepth = 256;

// Per worker thread: one tile product's slice of x, [kSddPanelDepth][kPanel] (SddPanelItem).
float* ThreadSliceBuffer() {
  static thread_local float slice[kSddPanelDepth * kPanel] __attribute__((aligned(64)));
  return slice;
}

// Rows of the chunk of x and dy widened to float32, 16 rows an item.
void SddPanelWidenItem(void* arg, int64_t item) {
  const SddPanelJob& job = *static_cast<const SddPanelJob*>(arg);
  const SddParams& p = *job.p;
  WidenRows(job.in, p.x, int64_t{p.cb} * p.bs, job.row0, job.rows, item, job.wide_x);
  WidenRows(job.in, p.dy, int64_t{p.kb} * p.bs, job.row0, job.rows, item, job.wide_dy);
}

template <int BS>
void SddPanelItem(void* arg, int64_t t) {
  const SddPanelJob& job = *static_cast<const SddPanelJob*>(arg);
  const SddParams& p = *job.p;
  constexpr int G = kPanel / BS;
  const int64_t P = job.tile_cell[t] / job.col_panels, Q = job.tile_cell[t] % job.col_panels;
  const int64_t fin = int64_t{p.cb} * BS, fout = int64_t{p.kb} * BS;
  const int64_t width = Min(int64_t{kPanel}, fin - P * kPanel);  // the tile's rows (the last row panel may be partial)
  float* acc = ThreadScratch().acc;                              // [kPanel, kPanel]
  std::memset(acc, 0, sizeof(float) * width * kPanel);
  // A = X[:, P]^T: element (r, k) at x[k, P * 128 + r], its rows of x copied into `a`
  // [depth][128] for each product. Read in place, one line from each of 256 rows a row
  // of x apart, they left the caches between the register tiles that share them: at
  // C = K = 4096 (1024 rows, density 1) the tiles ran at 0.81-0.87 of XLA's x.T @ dy,
  // copied at 0.95-1.0 (1024 cubed alike). B = DY[:, Q], row-major, read in place.
  float* a = ThreadSliceBuffer();
  for (int64_t k0 = 0; k0 < job.rows; k0 += kSddPanelDepth) {
    const int64_t depth = Min(kSddPanelDepth, job.rows - k0);
    for (int64_t k = 0; k < depth; ++k) {
      std::memcpy(a + k * kPanel, job.x + (k0 + k) * fin + P * kPanel, sizeof(float) * width);
    }
    Gemm<kPanel>(width, depth, a, 1, kPanel, job.dy + k0 * fout + Q * kPanel, fout, acc, kPanel);
  }
  for (int32_t e = job.tile_ptr[t]; e < job.tile_ptr[t + 1]; ++e) {
    const int64_t slot = job.tile_slots[e];
    const float* block = acc + (p.block_rows[slot] - P * G) * BS * kPanel + (p.block_cols[slot] - Q * G) * BS;
    if (job.accumulators == nullptr) {  // one chunk, 16-bit dw: narrowed at once
      for (int i = 0; i < BS; ++i) Narrow(block + i * kPanel, job.out, Offset(p.dw, (slot * BS + i) * BS, job.out), BS);
      continue;
    }
    float* sum = job.accumulators + slot * BS * BS;
    for (int i = 0; i < BS; ++i) {
      if (job.first) {
        std::memcpy(sum + i * BS, block + i * kPanel, sizeof(float) * BS);
      } else {
        for (int j = 0; j < BS; ++j) sum[i * BS + j] += block[i * kPanel + j];
      }
    }
    if (job.last && job.out != DType::kF32) Narrow(sum, job.out, Offset(p.dw, slot * BS * BS, job.out), BS * BS);
  }
}

// The tiles that hold blocks and each one's slots, in slot order; false where panels do
// not apply: K not a multiple of 128 (a tile reads 128 columns of dy), too few
// multiply-adds on present blocks (kSddPanelMinFill), or no memory.
template <int BS>
bool PlanSddPanels(const SddParams& p, int64_t nnz, SddPanelJob* job) {
  constexpr int G = kPanel / BS;
  if (p.kb % G != 0 || nnz == 0) return false;
  const int64_t row_panels = CeilDiv(p.cb, G), col_panels = p.kb / G, cells = row_panels * col_panels;
  // int32 tables in one caller buffer: each cell's tile (-1 for none), each tile's next
  // free entry; tile_cell, tile_ptr, tile_slots.
  auto* base = reinterpret_cast<int32_t*>(CallerBuffer(3).Get(4 * cells + 1 + nnz));
  if (base == nullptr) return false;
  int32_t* tile_of = base;
  int32_t* next = tile_of + cells;
  int32_t* tile_cell = next + cells;
  int32_t* tile_ptr = tile_cell + cells;
  int32_t* tile_slots = tile_ptr + cells + 1;
  for (int64_t c = 0; c < cells; ++c) tile_of[c] = -1;
  // A slot's cell, or -1 where it holds no block.
  auto cell_of = [&](int64_t slot) -> int64_t {
    if (!SddSlotHoldsBlock(p, nnz, slot)) return -1;
    return int64_t{p.block_rows[slot] / G} * col_panels + p.block_cols[slot] / G;
  };
  int64_t tiles = 0, used = 0, tile_rows = 0;
  for (int64_t s = 0; s < nnz; ++s) {
    const int64_t c = cell_of(s);
    if (c < 0) continue;
    ++used;
    if (tile_of[c] < 0) {
      tile_of[c] = static_cast<int32_t>(tiles);
      tile_cell[tiles] = static_cast<int32_t>(c);
      next[tiles] = 0;
      tile_rows += Min(int64_t{kPanel}, int64_t{p.cb} * BS - (c / col_panels) * kPanel);
      ++tiles;
    }
    ++next[tile_of[c]];  // the tile's slot count, for now
  }
  if (tiles == 0 || used * BS * BS < kSddPanelMinFill<BS> * tile_rows * kPanel) return false;
  tile_ptr[0] = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    tile_ptr[t + 1] = tile_ptr[t] + next[t];
    next[t] = tile_ptr[t];
  }
  for (int64_t s = 0; s < nnz; ++s) {
    const int64_t c = cell_of(s);
    if (c >= 0) tile_slots[next[tile_of[c]]++] = static_cast<int32_t>(s);
  }
  job->col_panels = col_panels;
  job->tile_cell = tile_cell;
  job->tile_ptr = tile_ptr;
  job->tile_slots = tile_slots;
  job->tiles = tiles;
  return true;
}

// updat on panels; false where they do not apply (nothing written then).
template <int BS>
bool RunSddPanels(const SddJob& sdd, const Parallel& par) {
  if constexpr (BS > 16 || JBS_CPU_LANES != 16) {
    return false;
  } else {
    const SddParams& p = *sdd.p;
    SddPanelJob job{};
    job.p = &p;
    job.in = sdd.in;
    job.out = sdd.out;
    job.nnz = sdd.nnz;
    if (!PlanSddPanels<BS>(p, sdd.nnz, &job)) return false;
    const int64_t fin = int64_t{p.cb} * BS, fout = int64_t{p.kb} * BS;
    // float32 rows are read in place, all at once; 16-bit ones widened a chunk at a time.
    const bool widens = job.in != DType::kF32;
    const int64_t chunk = widens ? Max(1, kPackFloats / (fin + fout)) : Max(1, p.n);
    const int64_t chunks = Max(1, CeilDiv(p.n, chunk));
    if (widens) {
      job.wide_x = CallerBuffer(0).Get(Min(chunk, p.n) * fin);
      job.wide_dy = CallerBuffer(1).Get(Min(chunk, p.n) * fout);
      if (job.wide_x == nullptr || job.wide_dy == nullptr) return false;
    }
    bool ok;
    job.accumulators = SddAccumulators(p, job.out == DType::kF32, chunks, &ok);
    if (!ok) return false;
    for (int64_t c = 0; c < chunks; ++c) {
      job.Select(p.n, chunk, chunks, c);
      if (widens) {
        par.for_each(par.ctx, CeilDiv(job.rows, 16), &SddPanelWidenItem, &job);
        job.x = job.wide_x;
        job.dy = job.wide_dy;
      } else {
        job.x = static_cast<const float*>(p.x);
        job.dy = static_cast<const float*>(p.dy);
      }
      par.for_each(par.ctx, job.tiles, &SddPanelItem<BS>, &job);
    }
    // Slots that hold no block (padding, tables out of range): zeros (all-zero bits in
    // every output dtype).
    const int64_t block_bytes = BS * BS * ElementBytes(job.out);
    for (int64_t s = 0; s < p.cap; ++s) {
      if (!SddSlotHoldsBlock(p, sdd.nnz, s)) std::memset(static_cast<char*>(p.dw) + s * block_bytes, 0, block_bytes);
    }
    return true;
  }
}

}  // namespace

bool RunDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par) {
  DsdJob job{};
  job.p = &p;
  job.in = in;
  job.out = out_f32 ? DType::kF32 : in;
  job.transpose_w = transpose_w;
  job.nnz = SlotsInUse(p.nnz, p.cap);
  const bool ok = DispatchBlockSize(p.bs, [&](auto bs) { return RunDsdBlock<decltype(bs)::value>(job, par); });
  ReleaseLargeBuffers();
  return ok;
}

bool RunSdd(DType in, bool out_f32, const SddParams& p, const Parallel& par) {
  SddJob job{};
  job.p = &p;
  job.in = in;
  job.out = out_f32 ? DType::kF32 : in;
  job.nnz = SlotsInUse(p.nnz, p.cap);
  const bool ok = DispatchBlockSize(p.bs, [&](auto bs) { return RunSddBlock<decltype(bs)::value>(job, par); });
  ReleaseLargeBuffers();
  return ok;
}

}  // namespace JBS_CPU_ISA
}  // namespace cpu
}  // namespace jbs
