// CPU kernels of the block-sparse convolution and its weight gradient (implicit GEMM),
// compiled once per instruction set like bsmm_cpu_kernels.cc (read bsconv_cpu.h first
// for what they compute, and bsmm_cpu.h for why no C++ library template is used here).
//
// Both are sums of small products accumulated in float32 registers by one routine,
// TileSegments<L, NV, R>: C[R rows][NV vectors of L floats] += sum over a list of
// segments i of A_i[R, K_i] @ B_i[K_i, NV*L]. The accumulators stay in registers across
// the whole list, so a tile of outputs is loaded and stored once however many
// (slot, tap) pairs feed it.
//
//   convolution, one work item = one output block column j x one run of outputs
//   (fixed batch index and outer spatial coordinates, one phase of the innermost dim):
//     segments = every (slot s of column j, tap t) whose input run is not all padding;
//     A = the run of input positions that tap reads, in the widened copy of the input
//     (rows istep * bs floats apart), B = the tap's weight block, K = bs.
//   weight gradient, one work item = one (slot, tap):
//     segments = every run of outputs, clipped to the positions whose input is in range;
//     A = the input run read transposed (A[r][k] = input position k, channel r),
//     B = the output gradient's run, K = the run's length.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bsmm_block_sizes.h"
#include "bsmm_problem.h"
#include "cpu/bsconv_cpu.h"
#include "cpu/bsconv_runs.h"  // the geometry: lines, runs, segments
#include "cpu/cpu_simd.h"     // 16-bit conversions, vector types, Splat, Buffer (needs JBS_CPU_ISA)

namespace jbs {
namespace cpu {
namespace JBS_CPU_ISA {
namespace {

// ---------------------------------------------------------------------------------
// The register tile over a list of segments
// ---------------------------------------------------------------------------------

// Products that all add into one tile: A_i[r][k] = a[i][r * a_row + k * a_k] (a_k == 1
// when kRowMajorA, else a_row == 1) and B_i[k][j] = b[i][k * ldb + j].
struct Segments {
  int64_t count;
  const float* const* a;
  const float* const* b;
  const int32_t* k;  // [count] reduction lengths, or nullptr: every segment has k_all
  int64_t k_all;
  int64_t a_row, a_k, ldb;
};

// C[r * ldc + j] (+)= sum over segments of A_i @ B_i for r < R, j < NV * L; the A rows
// start a_off floats into each A_i, the B columns b_off floats into each B_i.
template <int L, int NV, int R, bool kRowMajorA>
void TileSegments(const Segments& s, int64_t a_off, int64_t b_off, float* C, int64_t ldc, bool load) {
  typedef typename VecOf<L>::type V;
  typedef typename VecOf<L>::unaligned U;
  V c[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) c[r][v] = load ? *reinterpret_cast<const U*>(C + r * ldc + v * L) : V{};
  const int64_t a_row = s.a_row, a_k = s.a_k, ldb = s.ldb;
  for (int64_t i = 0; i < s.count; ++i) {
    const float* a = s.a[i] + a_off;
    const float* b = s.b[i] + b_off;
    const int64_t K = s.k ? s.k[i] : s.k_all;
    for (int64_t k = 0; k < K; ++k) {
      V bv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) bv[v] = *reinterpret_cast<const U*>(b + v * L);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const V av = Splat<V, L>(kRowMajorA ? a + r * a_row : a + r);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) c[r][v] += av * bv[v];
      }
      a += kRowMajorA ? 1 : a_k;
      b += ldb;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) *reinterpret_cast<U*>(C + r * ldc + v * L) = c[r][v];
}

// TileSegments with R chosen at run time (1..RMAX).
template <int L, int NV, int R, bool kRowMajorA>
struct TileOfRows {
  static void Run(int rows, const Segments& s, int64_t a_off, int64_t b_off, float* C, int64_t ldc, bool load) {
    if (rows == R) {
      TileSegments<L, NV, R, kRowMajorA>(s, a_off, b_off, C, ldc, load);
    } else {
      TileOfRows<L, NV, R - 1, kRowMajorA>::Run(rows, s, a_off, b_off, C, ldc, load);
    }
  }
};
template <int L, int NV, bool kRowMajorA>
struct TileOfRows<L, NV, 0, kRowMajorA> {
  static void Run(int, const Segments&, int64_t, int64_t, float*, int64_t, bool) {}
};

// Register tile per block size: L floats per vector, NV vectors per row (the columns of
// one pass), at most R rows. R * NV accumulators + NV + 1 registers fit the register
// file (16 vector registers, 32 for 16-float vectors with AVX-512).
template <int BS>
struct ConvTile {
  static constexpr int kLanes = JBS_CPU_LANES < BS ? JBS_CPU_LANES : BS;
  static constexpr int kVectors = BS / kLanes >= 2 ? 2 : 1;
  static constexpr bool kWide = kLanes == 16;
  static constexpr int kRows = kVectors == 2 ? (kWide ? 12 : 6) : (kWide ? 16 : 12);
};

// C[rows, BS] (+)= the segments' products, as tiles of at most kRows rows (sized evenly,
// so that no tile is much shorter than the others) times passes of NV * L columns.
template <int BS, bool kRowMajorA>
void Product(const Segments& s, int64_t rows, float* C, int64_t ldc, bool load) {
  constexpr int L = ConvTile<BS>::kLanes, NV = ConvTile<BS>::kVectors, R = ConvTile<BS>::kRows;
  const int64_t tiles = CeilDiv(rows, R);
  int64_t r0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int tile_rows = static_cast<int>(rows / tiles + (t < rows % tiles ? 1 : 0));
    const int64_t a_off = r0 * s.a_row;
    for (int j = 0; j < BS; j += NV * L) {
      TileOfRows<L, NV, R, kRowMajorA>::Run(tile_rows, s, a_off, j, C + r0 * ldc + j, ldc, load);
    }
    r0 += tile_rows;
  }
}

// Widens block `block` of rows [n, positions, blocks * BS] for batch index `b` into
// dst[positions][BS], leaving `pad_lo` / `pad_hi` zero rows around every run of
// `inner` positions.
template <int BS>
void PackRows(DType in, const void* src, int64_t blocks, int64_t positions, int64_t inner, int64_t pad_lo,
              int64_t pad_hi, int64_t b, int64_t block, float* dst) {
  const int64_t ld = blocks * BS;
  const int64_t runs = inner > 0 ? positions / inner : 0;
  for (int64_t r = 0; r < runs; ++r) {
    float* run = dst + r * (pad_lo + inner + pad_hi) * BS;
    std::memset(run, 0, sizeof(float) * pad_lo * BS);
    for (int64_t i = 0; i < inner; ++i) {
      const int64_t row = b * positions + r * inner + i;
      Widen(in, Offset(src, row * ld + block * BS, in), run + (pad_lo + i) * BS, BS);
    }
    std::memset(run + (pad_lo + inner) * BS, 0, sizeof(float) * pad_hi * BS);
  }
}

// Per-thread growable scratch of the work items (items run on pool threads).
struct ItemScratch {
  Buffer floats;    // accumulator tile
  Buffer pointers;  // segment A and B pointers (2 per segment, as floats' storage)
  Buffer lengths;   // segment lengths (int32, as floats' storage)
};

ItemScratch& ThreadItemScratch() {
  static thread_local ItemScratch scratch;
  return scratch;
}

// The calling thread's buffers (cpu_simd.h) hold: 0 the widened input, 1 the second
// operand (the weights, or the output gradient), 2 the run plan.

// ---------------------------------------------------------------------------------
// The convolution
// ---------------------------------------------------------------------------------

struct ConvJob {
  const ConvParams* p;
  DType in, out;
  int64_t nnz;
  const ConvPlan* plan;
  float* packed;         // [nin][n][in_outer][wp][bs]
  const float* weights;  // [cap][taps][bs][bs], M(t) of slot s at [s][t] (transposed if needed)
  int* failed;           // set when an item found no scratch memory
};

template <int BS>
void ConvPackItem(void* arg, int64_t item) {
  const ConvJob& job = *static_cast<const ConvJob*>(arg);
  const ConvPlan& plan = *job.plan;
  const ConvParams& p = *job.p;
  const int64_t block = item / p.n, b = item % p.n;
  const int64_t positions = plan.l.in_outer * plan.l.in_inner;
  float* dst = job.packed + (block * p.n + b) * plan.l.in_outer * plan.wp * BS;
  PackRows<BS>(job.in, p.a, p.nin, positions, plan.l.in_inner, plan.runs.pad_lo, plan.runs.pad_hi, b, block, dst);
}

// Weights as the products take them: float32 [bs_in][bs_out] per (slot, tap).
template <int BS>
void ConvWeightItem(void* arg, int64_t slot) {
  const ConvJob& job = *static_cast<const ConvJob*>(arg);
  const ConvPlan& plan = *job.plan;
  const ConvParams& p = *job.p;
  float* dst = const_cast<float*>(job.weights) + slot * plan.l.taps * BS * BS;
  for (int64_t t = 0; t < plan.l.taps; ++t, dst += BS * BS) {
    const void* src = Offset(p.w, (slot * plan.l.taps + t) * BS * BS, job.in);
    if (!p.transpose_kernel) {
      Widen(job.in, src, dst, BS * BS);
      continue;
    }
    WidenTransposed<BS>(job.in, src, dst);
  }
}

template <int BS>
void ConvItem(void* arg, int64_t item) {
  const ConvJob& job = *static_cast<const ConvJob*>(arg);
  const ConvPlan& plan = *job.plan;
  const ConvParams& p = *job.p;
  const Lines& l = plan.l;
  ConvItemOf it;
  if (!DecodeConvItem(p, plan, item, &it)) return;
  const Unit& unit = *it.unit;
  const int64_t seg = it.seg, row0 = it.row0;

  ItemScratch& scratch = ThreadItemScratch();
  const float** A = reinterpret_cast<const float**>(scratch.pointers.Get(4 * plan.max_segments + 4));
  float* acc = scratch.floats.Get(kUnitRows * BS);
  if (A == nullptr || acc == nullptr) {
    __atomic_store_n(job.failed, 1, __ATOMIC_RELAXED);
    return;
  }
  const float** B = A + plan.max_segments;

  const int64_t count =
      ListConvSegments<float>(p, plan, job.nnz, job.packed, job.weights, seg, it.b, it.o_outer, unit, A, B);

  const int64_t fout = int64_t{p.nseg} * BS;
  if (job.out == DType::kF32) {
    // Straight into the output: rows ostep outputs apart.
    float* C = static_cast<float*>(p.out) + row0 * fout + seg * BS;
    const int64_t ldc = l.ostep * fout;
    if (count == 0) {
      for (int64_t m = 0; m < unit.len; ++m) std::memset(C + m * ldc, 0, sizeof(float) * BS);
      return;
    }
    const Segments s{count, A, B, nullptr, BS, l.istep * BS, 1, BS};
    Product<BS, true>(s, unit.len, C, ldc, false);
    return;
  }
  if (count == 0) {
    std::memset(acc, 0, sizeof(float) * unit.len * BS);
  } else {
    const Segments s{count, A, B, nullptr, BS, l.istep * BS, 1, BS};
    Product<BS, true>(s, unit.len, acc, BS, false);
  }
  for (int64_t m = 0; m < unit.len; ++m) {
    Narrow(acc + m * BS, job.out, Offset(p.out, (row0 + m * l.ostep) * fout + seg * BS, job.out), BS);
  }
}

template <int BS>
bool RunConvBlock(ConvJob& job, const Parallel& par) {
  const ConvParams& p = *job.p;
  ConvPlan plan;
  if (!MakeConvPlan(p, &plan)) return false;
  job.plan = &plan;
  const Lines& l = plan.l;

  // The widened input with its zero border, and the weights as the products take them.
  const int64_t packed_floats = int64_t{p.nin} * p.n * l.in_outer * plan.wp * BS;
  job.packed = CallerBuffer(0).Get(Max(packed_floats, 1));
  if (job.packed == nullptr) return false;
  if (packed_floats > 0) par.for_each(par.ctx, int64_t{p.nin} * p.n, &ConvPackItem<BS>, &job);
  if (job.in == DType::kF32 && !p.transpose_kernel) {
    job.weights = static_cast<const float*>(p.w);  // in place
  } else {
    float* weights = CallerBuffer(1).Get(Max(job.nnz * l.taps * BS * BS, 1));
    if (weights == nullptr) return false;
    job.weights = weights;
    if (job.nnz > 0) par.for_each(par.ctx, job.nnz, &ConvWeightItem<BS>, &job);
  }
  int failed = 0;
  job.failed = &failed;
  par.for_each(par.ctx, int64_t{p.nseg} * plan.lines * plan.runs.num_units, &ConvItem<BS>, &job);
  return __atomic_load_n(&failed, __ATOMIC_RELAXED) == 0;
}

// ---------------------------------------------------------------------------------
// The weight gradient
// ---------------------------------------------------------------------------------

struct WgradJob {
  const ConvWgradParams* p;
  DType in, out;
  int64_t nnz;
  Lines l;
  int64_t lines;
  float* pa;                // [a_blocks][n][in positions][bs]
  float* pb;                // [b_blocks][n][out positions][bs]
  const int64_t* outer_in;  // [out_outer][k_outer] (OuterTable)
  const int64_t* tap_i0;    // [phases][k_inner] inner input start, or kNoInput
  int64_t max_segments;
  int64_t chunk;  // reduction length per pass over the accumulator (operands stay in L1)
  int* failed;    // set when an item found no scratch memory
};

template <int BS>
void WgradPackItem(void* arg, int64_t item) {
  const WgradJob& job = *static_cast<const WgradJob*>(arg);
  const ConvWgradParams& p = *job.p;
  const int64_t a_items = int64_t{p.a_blocks} * p.n;
  if (item < a_items) {
    const int64_t block = item / p.n, b = item % p.n;
    const int64_t positions = job.l.in_outer * job.l.in_inner;
    PackRows<BS>(job.in, p.a, p.a_blocks, positions, job.l.in_inner, 0, 0, b, block,
                 job.pa + (block * p.n + b) * positions * BS);
  } else {
    const int64_t block = (item - a_items) / p.n, b = (item - a_items) % p.n;
    const int64_t positions = job.l.out_outer * job.l.out_inner;
    PackRows<BS>(job.in, p.b, p.b_blocks, positions, job.l.out_inner, 0, 0, b, block,
                 job.pb + (block * p.n + b) * positions * BS);
  }
}

template <int BS>
void WgradItem(void* arg, int64_t item) {
  const WgradJob& job = *static_cast<const WgradJob*>(arg);
  const ConvWgradParams& p = *job.p;
  const ConvGeometry& g = p.g;
  const Lines& l = job.l;
  const int64_t slot = item / l.taps, tap = item % l.taps;
  void* dst = Offset(p.dw, item * BS * BS, job.out);
  ItemScratch& scratch = ThreadItemScratch();
  float* acc = job.out == DType::kF32 ? static_cast<float*>(dst) : scratch.floats.Get(BS * BS);
  const float** lhs = reinterpret_cast<const float**>(scratch.pointers.Get(4 * job.max_segments + 4));
  int32_t* lengths = reinterpret_cast<int32_t*>(scratch.lengths.Get(job.max_segments + 1));
  if (acc == nullptr || lhs == nullptr || lengths == nullptr) {
    __atomic_store_n(job.failed, 1, __ATOMIC_RELAXED);
    return;
  }
  const float** rhs = lhs + job.max_segments;
  std::memset(acc, 0, sizeof(float) * BS * BS);

  const int64_t rb = slot < job.nnz ? p.block_rows[slot] : -1;
  const int64_t cb = slot < job.nnz ? p.block_cols[slot] : -1;
  // plain: rows(s) index a's channels, cols(s) b's; transpose_kernel: the other way round.
  const int64_t a_block = p.transpose_kernel ? cb : rb, b_block = p.transpose_kernel ? rb : cb;
  const bool valid = rb >= 0 && cb >= 0 && a_block < p.a_blocks && b_block < p.b_blocks;
  int64_t count = 0;
  // Floats between consecutive positions of a run of each operand.
  const int64_t l_step = (p.transpose_kernel ? l.ostep : l.istep) * BS;
  const int64_t r_step = (p.transpose_kernel ? l.istep : l.ostep) * BS;
  if (valid) {
    const int64_t gtap = p.transpose_kernel ? l.taps - 1 - tap : tap;  // the tap the geometry reads
    const int64_t to = gtap / l.k_inner, ti = gtap % l.k_inner;
    const int64_t in_run = l.in_outer * l.in_inner, out_run = l.out_outer * l.out_inner;
    for (int64_t line = 0; line < job.lines; ++line) {
      const int64_t b = line / l.out_outer, o_outer = line % l.out_outer;
      const int64_t i_outer = job.outer_in[o_outer * (l.taps / l.k_inner) + to];
      if (i_outer < 0) continue;
      const float* a_line = job.pa + ((a_block * p.n + b) * in_run + i_outer * l.in_inner) * BS;
      const float* b_line = job.pb + ((b_block * p.n + b) * out_run + o_outer * l.out_inner) * BS;
      for (int64_t ph = 0; ph < l.phases; ++ph) {
        const int64_t i0 = job.tap_i0[ph * l.k_inner + ti];
        if (i0 == kNoInput) continue;
        // Outputs m of the phase whose input i0 + m * istep is in range.
        const int64_t length = PhaseLength(l, ph);
        const int64_t m_lo = i0 >= 0 ? 0 : CeilDiv(-i0, l.istep);
        const int64_t m_hi = i0 > l.in_inner - 1 ? 0 : Min(length, (l.in_inner - 1 - i0) / l.istep + 1);
        for (int64_t m = m_lo; m < m_hi; m += job.chunk) {
          const float* a_run = a_line + (i0 + m * l.istep) * BS;
          const float* b_run = b_line + (ph + m * l.ostep) * BS;
          const float* l_run = p.transpose_kernel ? b_run : a_run;
          const float* r_run = p.transpose_kernel ? a_run : b_run;
          const int64_t len = Min(job.chunk, m_hi - m);
          // A run that continues the previous one in both operands (the next line of a
          // whole-width tap) extends it: fewer, longer segments.
          if (count > 0 && lengths[count - 1] + len <= job.chunk &&
              lhs[count - 1] + lengths[count - 1] * l_step == l_run &&
              rhs[count - 1] + lengths[count - 1] * r_step == r_run) {
            lengths[count - 1] += static_cast<int32_t>(len);
            continue;
          }
          lhs[count] = l_run;
          rhs[count] = r_run;
          lengths[count] = static_cast<int32_t>(len);
          ++count;
        }
      }
    }
  }
  // acc[BS, BS] = sum of lhs^T @ rhs, in passes of about `chunk` positions.
  for (int64_t first = 0; first < count;) {
    int64_t last = first, total = 0;
    while (last < count && (last == first || total + lengths[last] <= job.chunk)) total += lengths[last++];
    const Segments s{last - first, lhs + first, rhs + first, lengths + first, 0, 1, l_step, r_step};
    Product<BS, false>(s, BS, acc, BS, true);
    first = last;
  }
  if (job.out != DType::kF32) Narrow(acc, job.out, dst, BS * BS);
}

template <int BS>
bool RunWgradBlock(WgradJob& job, const Parallel& par) {
  const ConvWgradParams& p = *job.p;
  Lines& l = job.l;
  l = MakeLines(p.g);
  job.lines = p.n * l.out_outer;
  // Both operand runs of a pass, chunk x BS floats each, fit in about 24 KiB of L1.
  job.chunk = Max(8, 3072 / BS);
  int64_t per_line = 0;
  for (int64_t ph = 0; ph < l.phases; ++ph) per_line += CeilDiv(PhaseLength(l, ph), job.chunk);
  job.max_segments = Max(1, job.lines * per_line);
  const int64_t a_floats = int64_t{p.a_blocks} * p.n * l.in_outer * l.in_inner * BS;
  const int64_t b_floats = int64_t{p.b_blocks} * p.n * l.out_outer * l.out_inner * BS;
  const std::vector<int64_t> outer_in = OuterTable(p.g, l.out_outer, l.taps / l.k_inner);
  std::vector<int64_t> tap_i0(static_cast<size_t>(l.phases * l.k_inner));
  TapStarts(p.g, l, tap_i0.data());
  job.outer_in = outer_in.data();
  job.tap_i0 = tap_i0.data();
  job.pa = CallerBuffer(0).Get(Max(a_floats, 1));
  job.pb = CallerBuffer(1).Get(Max(b_floats, 1));
  if (job.pa == nullptr || job.pb == nullptr) return false;
  par.for_each(par.ctx, int64_t{p.a_blocks + p.b_blocks} * p.n, &WgradPackItem<BS>, &job);
  int failed = 0;
  job.failed = &failed;
  par.for_each(par.ctx, int64_t{p.cap} * l.taps, &WgradItem<BS>, &job);
  return __atomic_load_n(&failed, __ATOMIC_RELAXED) == 0;
}

}  // namespace

bool RunConv(DType in, bool out_f32, const ConvParams& p, const Parallel& par) {
  ConvJob job{};
  job.p = &p;
  job.in = in;
  job.out = out_f32 ? DType::kF32 : in;
  job.nnz = SlotsInUse(p.nnz, p.cap);
  const bool ok = DispatchBlockSize(p.bs, [&](auto bs) { return RunConvBlock<decltype(bs)::value>(job, par); });
  ReleaseLargeBuffers();
  return ok;
}

bool RunConvWgrad(DType in, bool out_f32, const ConvWgradParams& p, const Parallel& par) {
  WgradJob job{};
  job.p = &p;
  job.in = in;
  job.out = out_f32 ? DType::kF32 : in;
  job.nnz = SlotsInUse(p.nnz, p.cap);
  const bool ok = DispatchBlockSize(p.bs, [&](auto bs) { return RunWgradBlock<decltype(bs)::value>(job, par); });
  ReleaseLargeBuffers();
  return ok;
}

}  // namespace JBS_CPU_ISA
}  // namespace cpu
}  // namespace jbs
