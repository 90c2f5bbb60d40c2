// The bfloat16 convolution on AMX tiles: the problem of bsconv_cpu.h (forward, input
// gradient, transposed convolution), with its products on TDPBF16PS instead of widening
// to float32 (bsconv_cpu_kernels.cc).
//
// Compiled once, with the AMX and AVX512-BF16 flags (CMakeLists.txt), like
// bsmm_cpu_bf16.cc; the dispatcher (bsmm_cpu_dispatch.cc) calls it for bfloat16 inputs,
// blocks of bf16::kMinBlock or more, on "amx" only: the convolution always, the weight
// gradient where WgradOnTiles says its geometry has a tile form.
//
// The same plan as the widening kernel (bsconv_runs.h): one work item is one output
// block column x one run of up to kUnitRows outputs of a line, summing every (slot, tap)
// segment that feeds it. Here:
//   * the input is copied once per call, as bf16, into the block-major [nin][n][in_outer]
//     [wp][bs] layout with its zero border: an A tile is 16 outputs of a run (rows
//     istep * bs bf16 apart, a tile load's stride) x 32 channels of the block (16 for
//     block 16, half a tile's depth);
//   * every (slot, tap) weight block is VNNI-packed once per call in column tiles
//     (PackWeight, transposed for transpose_kernel);
//   * an item sums its segments in 2 x 2 accumulator tiles (32 outputs x 32 channels),
//     its tiles configured to the run's length, then writes the float32 sums to the
//     output (narrowed to bf16 where the output is bf16).
// Summation order: per output element, segment by segment (slots in segment order, taps
// in kernel order), within a block in pairs of channels as TDPBF16PS adds them.
//
// The weight gradient, for unit steps along the innermost dim (stride == input dilation:
// every output of a line reads the input positions i0 + m, m < L, L = the line's
// outputs, even) is one work item per (slot, tap) summing over the lines
//   C[i][j] += sum over m of a[i0 + m][i] * b[m][j]     (a: the input, b: the output gradient)
// with A = the input's line transposed ([bs][wp] per block and line, zero-padded so that
// every tap reads L positions without clipping: a tap's shift is where its tiles start) and
// B = the output gradient's line VNNI-packed along m ([L / 2][bs][2]); both are packed once
// per call. Lines of 32 positions per step, then the last L % 32 with the tiles
// reconfigured to that depth (nothing read past a line). With transpose_kernel the roles
// of the layout's rows and columns swap, so C is stored transposed. Summation order: line
// by line, 32 positions per step (pairs as TDPBF16PS adds them); other geometries widen.
#if defined(JBS_CPU_BF16_KERNELS)

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bsmm_block_sizes.h"
#include "bsmm_problem.h"
#include "cpu/bf16_tiles.h"  // VNNI packing, AMX tile steps, narrowing
#include "cpu/bsconv_cpu.h"
#include "cpu/bsconv_runs.h"  // the geometry: lines, runs, segments
#include "cpu/cpu_simd.h"     // buffers, Min/Max/CeilDiv (needs JBS_CPU_ISA: bf16)

namespace jbs {
namespace cpu {
namespace bf16 {
namespace {

struct ConvJob {
  const ConvParams* p;
  bool out_f32;
  int64_t nnz;
  const ConvPlan* plan;
  uint16_t* packed;   // [nin][n][in_outer][wp][bs] bf16
  uint16_t* weights;  // [nnz][taps][bs][bs] VNNI-packed in column tiles
  int* failed;        // set when an item found no scratch memory
};

// Copies block `block` of batch index b of the input into its runs of the packed input,
// with the zero rows around each.
template <int BS>
void ConvPackItem(void* arg, int64_t item) {
  const ConvJob& job = *static_cast<const ConvJob*>(arg);
  const ConvPlan& plan = *job.plan;
  const ConvParams& p = *job.p;
  const Lines& l = plan.l;
  const int64_t block = item / p.n, b = item % p.n;
  const int64_t ld = int64_t{p.nin} * BS, positions = l.in_outer * l.in_inner;
  const uint16_t* src = static_cast<const uint16_t*>(p.a);
  uint16_t* dst = job.packed + (block * p.n + b) * l.in_outer * plan.wp * BS;
  for (int64_t r = 0; r < l.in_outer; ++r) {
    uint16_t* run = dst + r * plan.wp * BS;
    std::memset(run, 0, sizeof(uint16_t) * plan.runs.pad_lo * BS);
    for (int64_t i = 0; i < l.in_inner; ++i) {
      const int64_t row = b * positions + r * l.in_inner + i;
      std::memcpy(run + (plan.runs.pad_lo + i) * BS, src + row * ld + block * BS, sizeof(uint16_t) * BS);
    }
    std::memset(run + (plan.runs.pad_lo + l.in_inner) * BS, 0, sizeof(uint16_t) * plan.runs.pad_hi * BS);
  }
}

// The weights of one slot, every tap, as the tiles read them: M(t) = W(t) [in][out], or
// W(t)^T with transpose_kernel (the item reads tap T - 1 - t then).
template <int BS>
void ConvWeightItem(void* arg, int64_t slot) {
  const ConvJob& job = *static_cast<const ConvJob*>(arg);
  const ConvPlan& plan = *job.plan;
  const ConvParams& p = *job.p;
  const uint16_t* w = static_cast<const uint16_t*>(p.w);
  for (int64_t t = 0; t < plan.l.taps; ++t) {
    const int64_t at = (slot * plan.l.taps + t) * BS * BS;
    PackWeight<BS>(w + at, p.transpose_kernel, job.weights + at);
  }
}

// Per-thread scratch of the items: the segments' A and B pointers and the accumulators.
struct ItemScratch {
  Buffer pointers;                   // 2 per segment, as floats' storage
  alignas(64) float acc[128 * 128];  // the convolution's [kUnitRows][BS], the weight gradient's [BS][BS]
};

ItemScratch& ThreadItemScratch() {
  static thread_local ItemScratch scratch;
  return scratch;
}

// acc rows [r0, r0 + 32) (or 16: kBottom false), columns [c0, c0 + 16 * NC), summed over
// the segments: A[i] the run's first input row, rows a_stride bytes apart.
template <int BS, int NC, bool kBottom>
void SumSegments(const uint16_t* const* A, const uint16_t* const* B, int64_t count, int64_t a_stride, int64_t r0,
                 int c0, float* acc) {
  constexpr int kStep = BS < 32 ? BS : 32;  // channels per tile step
  const int64_t row_elems = a_stride / 2;
  AmxZero<NC, kBottom>();
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t* a = A[i] + r0 * row_elems;
    const uint16_t* b = B[i] + c0 * BS;
    for (int k0 = 0; k0 < BS; k0 += kStep) {
      AmxStep<NC, kBottom>(a + k0, a_stride, 16 * row_elems, b + k0 * 16, 64, 16 * BS);
    }
  }
  AmxStoreC<NC, kBottom>(acc + r0 * BS + c0, BS);
}

// Rows [r0, r0 + rows) of the unit (rows <= 32, the tiles configured for them), every
// column, into acc.
template <int BS>
void SumRows(const uint16_t* const* A, const uint16_t* const* B, int64_t count, int64_t a_stride, int64_t r0,
             int64_t rows, float* acc) {
  constexpr int NC = BS < 32 ? 1 : 2;
  for (int c0 = 0; c0 < BS; c0 += 16 * NC) {
    if (rows > 16) {
      SumSegments<BS, NC, true>(A, B, count, a_stride, r0, c0, acc);
    } else {
      SumSegments<BS, NC, false>(A, B, count, a_stride, r0, c0, acc);
    }
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

  ItemScratch& scratch = ThreadItemScratch();
  const uint16_t** A = reinterpret_cast<const uint16_t**>(scratch.pointers.Get(4 * plan.max_segments + 4));
  if (A == nullptr) {
    __atomic_store_n(job.failed, 1, __ATOMIC_RELAXED);
    return;
  }
  const uint16_t** B = A + plan.max_segments;
  const int64_t count =
      ListConvSegments<uint16_t>(p, plan, job.nnz, job.packed, job.weights, it.seg, it.b, it.o_outer, unit, A, B);

  float* acc = scratch.acc;
  if (count == 0) {
    std::memset(acc, 0, sizeof(float) * unit.len * BS);
  } else {
    constexpr int kStep = BS < 32 ? BS : 32, NC = BS < 32 ? 1 : 2;
    const int64_t a_stride = l.istep * BS * 2;  // bytes between the outputs' input rows
    const int64_t full = unit.len - unit.len % 32, tail = unit.len - full;
    if (full > 0) {  // one configuration for every whole group of 32 rows
      ConfigureTiles(16, 16, kStep, NC);
      for (int64_t r0 = 0; r0 < full; r0 += 32) SumRows<BS>(A, B, count, a_stride, r0, 32, acc);
    }
    if (tail > 0) {
      ConfigureTiles(static_cast<int>(Min(tail, 16)), static_cast<int>(Max(tail - 16, 0)), kStep, NC);
      SumRows<BS>(A, B, count, a_stride, full, tail, acc);
    }
    _tile_release();
  }

  const int64_t fout = int64_t{p.nseg} * BS;
  for (int64_t m = 0; m < unit.len; ++m) {
    const int64_t at = (it.row0 + m * l.ostep) * fout + it.seg * BS;
    if (job.out_f32) {
      std::memcpy(static_cast<float*>(p.out) + at, acc + m * BS, sizeof(float) * BS);
    } else {
      NarrowRow(acc + m * BS, static_cast<uint16_t*>(p.out) + at, BS);
    }
  }
}

template <int BS>
bool RunConvBlock(ConvJob& job, const Parallel& par) {
  const ConvParams& p = *job.p;
  ConvPlan plan;
  if (!MakeConvPlan(p, &plan)) return false;
  job.plan = &plan;
  const Lines& l = plan.l;

  // The input as bf16 runs with their zero border, and the weights as the tiles read them
  // (Buffer counts floats: two bf16 each).
  const int64_t packed_elems = int64_t{p.nin} * p.n * l.in_outer * plan.wp * BS;
  job.packed = reinterpret_cast<uint16_t*>(CallerBuffer(0).Get(Max(CeilDiv(packed_elems, 2), 1)));
  job.weights = reinterpret_cast<uint16_t*>(CallerBuffer(1).Get(Max(CeilDiv(job.nnz * l.taps * BS * BS, 2), 1)));
  if (job.packed == nullptr || job.weights == nullptr) return false;
  if (packed_elems > 0) par.for_each(par.ctx, int64_t{p.nin} * p.n, &ConvPackItem<BS>, &job);
  if (job.nnz > 0) par.for_each(par.ctx, job.nnz, &ConvWeightItem<BS>, &job);
  int failed = 0;
  job.failed = &failed;
  par.for_each(par.ctx, int64_t{p.nseg} * plan.lines * plan.runs.num_units, &ConvItem<BS>, &job);
  return __atomic_load_n(&failed, __ATOMIC_RELAXED) == 0;
}

// ---------------------------------------------------------------------------------
// The weight gradient
// ---------------------------------------------------------------------------------

// Whether the weight gradient of geometry g has the tile form: unit steps along the
// innermost dim and an even, nonzero number of outputs per line.
bool UnitStepLines(const ConvGeometry& g) {
  const Lines l = MakeLines(g);
  return l.istep == 1 && l.ostep == 1 && l.out_inner > 0 && l.out_inner % 2 == 0;
}

struct WgradJob {
  const ConvWgradParams* p;
  bool out_f32;
  int64_t nnz;
  Lines l;
  int64_t lines;          // n * out_outer
  int64_t pad_lo, wp;     // the transposed input's lines: pad_lo zeros, then in_inner positions; wp in all (even)
  const int64_t* tap_i0;  // [k_inner] (one phase)
  const int64_t* outer_in;
  uint16_t* at;  // [a_blocks][n][in_outer][bs][wp]: the input transposed per line
  uint16_t* bv;  // [b_blocks][n][out_outer][L / 2][bs][2]: the output gradient VNNI-packed per line
};

// One line of one block of the input, transposed: at_line[i][pad_lo + q] = a[q][i]. Per 32
// positions: positions q, q + 1 interleaved into 32-bit pairs, then the pairs transposed.
template <int BS>
void WgradPackInputLine(const WgradJob& job, int64_t block, int64_t b, int64_t i_outer) {
  const ConvWgradParams& p = *job.p;
  const Lines& l = job.l;
  const int64_t ld = int64_t{p.a_blocks} * BS;
  const uint16_t* src = static_cast<const uint16_t*>(p.a) + ((b * l.in_outer + i_outer) * l.in_inner) * ld + block * BS;
  uint16_t* line = job.at + ((block * p.n + b) * l.in_outer + i_outer) * BS * job.wp;
  const int64_t filled = CeilDiv(l.in_inner, 32) * 32;  // written by the transposes (zeros past in_inner)
  for (int i = 0; i < BS; ++i) {
    std::memset(line + i * job.wp, 0, sizeof(uint16_t) * job.pad_lo);
    std::memset(line + i * job.wp + job.pad_lo + filled, 0, sizeof(uint16_t) * (job.wp - job.pad_lo - filled));
  }
  alignas(64) uint16_t pairs[16 * 2 * BS];
  for (int64_t q0 = 0; q0 < l.in_inner; q0 += 32) {
    for (int64_t k = 0; k < 16; ++k) {
      const int64_t q = q0 + 2 * k;
      const uint16_t* r0 = q < l.in_inner ? src + q * ld : kZeros;
      const uint16_t* r1 = q + 1 < l.in_inner ? src + (q + 1) * ld : kZeros;
      InterleaveRows(r0, r1, pairs + k * 2 * BS, BS);
    }
    TransposeWords(reinterpret_cast<const uint32_t*>(pairs), BS, 16, BS,
                   reinterpret_cast<uint32_t*>(line + job.pad_lo + q0), job.wp / 2);
  }
}

// One line of one block of the output gradient, VNNI-packed along its positions:
// bv_line[m / 2][j][m % 2] = b[m][j].
template <int BS>
void WgradPackGradientLine(const WgradJob& job, int64_t block, int64_t b, int64_t o_outer) {
  const ConvWgradParams& p = *job.p;
  const Lines& l = job.l;
  const int64_t ld = int64_t{p.b_blocks} * BS;
  const uint16_t* src =
      static_cast<const uint16_t*>(p.b) + ((b * l.out_outer + o_outer) * l.out_inner) * ld + block * BS;
  uint16_t* line = job.bv + ((block * p.n + b) * l.out_outer + o_outer) * l.out_inner * BS;
  for (int64_t m = 0; m < l.out_inner; m += 2) InterleaveRows(src + m * ld, src + (m + 1) * ld, line + m * BS, BS);
}

template <int BS>
void WgradPackItem(void* arg, int64_t item) {
  const WgradJob& job = *static_cast<const WgradJob*>(arg);
  const ConvWgradParams& p = *job.p;
  const Lines& l = job.l;
  const int64_t a_lines = int64_t{p.a_blocks} * p.n * l.in_outer;
  if (item < a_lines) {
    WgradPackInputLine<BS>(job, item / (p.n * l.in_outer), (item / l.in_outer) % p.n, item % l.in_outer);
  } else {
    item -= a_lines;
    WgradPackGradientLine<BS>(job, item / (p.n * l.out_outer), (item / l.out_outer) % p.n, item % l.out_outer);
  }
}

// C tiles for rows [c0, c0 + 32) (16 for block 16) x columns [j0, j0 + 16 * NC) of the
// block, summed over every line at positions [m0, m0 + depth) (depth = the configured
// reduction). `load`: start from acc rather than zero; the tiles go back to acc.
template <int BS, int NC, bool kBottom>
void WgradTiles(const WgradJob& job, int64_t a_block, int64_t b_block, int64_t i0, int64_t to, int c0, int j0,
                int64_t m_first, int64_t m_end, int depth, bool load, float* acc) {
  const ConvWgradParams& p = *job.p;
  const Lines& l = job.l;
  const int64_t k_outer = l.taps / l.k_inner;
  if (load) {
    AmxLoadC<NC, kBottom>(acc + c0 * BS + j0, BS);
  } else {
    AmxZero<NC, kBottom>();
  }
  for (int64_t line = 0; line < job.lines; ++line) {
    const int64_t b = line / l.out_outer, o_outer = line % l.out_outer;
    const int64_t i_outer = job.outer_in[o_outer * k_outer + to];
    if (i_outer < 0) continue;
    const uint16_t* a = job.at + ((a_block * p.n + b) * l.in_outer + i_outer) * BS * job.wp + c0 * job.wp;
    const uint16_t* bv = job.bv + ((b_block * p.n + b) * l.out_outer + o_outer) * l.out_inner * BS + j0 * 2;
    for (int64_t m0 = m_first; m0 < m_end; m0 += depth) {
      AmxStep<NC, kBottom>(a + job.pad_lo + i0 + m0, job.wp * 2, 16 * job.wp, bv + m0 * BS, 4 * BS, 32);
    }
  }
  AmxStoreC<NC, kBottom>(acc + c0 * BS + j0, BS);
}

// Every tile of the block over positions [m_first, m_end) at one configured depth.
template <int BS>
void WgradPass(const WgradJob& job, int64_t a_block, int64_t b_block, int64_t i0, int64_t to, int64_t m_first,
               int64_t m_end, int depth, bool load, float* acc) {
  constexpr int NC = BS < 32 ? 1 : 2;
  constexpr bool kBottom = BS >= 32;
  ConfigureTiles(16, kBottom ? 16 : 0, depth, NC);
  for (int c0 = 0; c0 < BS; c0 += kBottom ? 32 : 16) {
    for (int j0 = 0; j0 < BS; j0 += 16 * NC) {
      WgradTiles<BS, NC, kBottom>(job, a_block, b_block, i0, to, c0, j0, m_first, m_end, depth, load, acc);
    }
  }
}

template <int BS>
void WgradItem(void* arg, int64_t item) {
  const WgradJob& job = *static_cast<const WgradJob*>(arg);
  const ConvWgradParams& p = *job.p;
  const Lines& l = job.l;
  const int64_t slot = item / l.taps, tap = item % l.taps;
  const int64_t rb = slot < job.nnz ? p.block_rows[slot] : -1;
  const int64_t cb = slot < job.nnz ? p.block_cols[slot] : -1;
  // The input's block and the output gradient's (the layout's rows and columns, swapped
  // with transpose_kernel).
  const int64_t a_block = p.transpose_kernel ? cb : rb, b_block = p.transpose_kernel ? rb : cb;
  const bool valid = rb >= 0 && cb >= 0 && a_block < p.a_blocks && b_block < p.b_blocks;
  const int64_t gtap = p.transpose_kernel ? l.taps - 1 - tap : tap;  // the tap the geometry reads
  const int64_t i0 = job.tap_i0[gtap % l.k_inner];
  float* acc = ThreadItemScratch().acc;  // [BS][BS]: C[input channel][output gradient channel]
  if (!valid || i0 == kNoInput) {
    std::memset(acc, 0, sizeof(float) * BS * BS);
  } else {
    const int64_t to = gtap / l.k_inner, whole = l.out_inner - l.out_inner % 32;
    if (whole > 0) WgradPass<BS>(job, a_block, b_block, i0, to, 0, whole, 32, false, acc);
    if (whole < l.out_inner) {
      WgradPass<BS>(job, a_block, b_block, i0, to, whole, l.out_inner, static_cast<int>(l.out_inner - whole), whole > 0,
                    acc);
    }
    _tile_release();
  }
  // dw[s][t] is [rows(s)][cols(s)]: C itself, or C transposed with transpose_kernel.
  float* dst32 = static_cast<float*>(p.dw) + item * BS * BS;
  uint16_t* dst16 = static_cast<uint16_t*>(p.dw) + item * BS * BS;
  alignas(64) float row[BS];
  for (int i = 0; i < BS; ++i) {
    const float* src = acc + i * BS;
    if (p.transpose_kernel) {
      for (int j = 0; j < BS; ++j) row[j] = acc[j * BS + i];
      src = row;
    }
    if (job.out_f32) {
      std::memcpy(dst32 + i * BS, src, sizeof(float) * BS);
    } else {
      NarrowRow(src, dst16 + i * BS, BS);
    }
  }
}

template <int BS>
bool RunWgradBlock(WgradJob& job, const Parallel& par) {
  const ConvWgradParams& p = *job.p;
  Lines& l = job.l;
  l = MakeLines(p.g);
  job.lines = p.n * l.out_outer;
  // One phase: the inner taps' starts, and the zero border every tap's L positions need.
  std::vector<int64_t> tap_i0(static_cast<size_t>(l.phases * l.k_inner));  // l.phases == 1
  TapStarts(p.g, l, tap_i0.data());
  int64_t lo = 0, hi = l.in_inner;
  for (const int64_t i0 : tap_i0) {
    if (i0 == kNoInput) continue;
    lo = Min(lo, i0);
    hi = Max(hi, i0 + l.out_inner);
  }
  job.tap_i0 = tap_i0.data();
  job.pad_lo = CeilDiv(-lo, 2) * 2;  // even: the transposes write 32-bit pairs
  job.wp = CeilDiv(Max(job.pad_lo + hi, job.pad_lo + CeilDiv(l.in_inner, 32) * 32), 2) * 2;
  const std::vector<int64_t> outer_in = OuterTable(p.g, l.out_outer, l.taps / l.k_inner);
  job.outer_in = outer_in.data();

  const int64_t a_lines = int64_t{p.a_blocks} * p.n * l.in_outer, b_lines = int64_t{p.b_blocks} * p.n * l.out_outer;
  job.at = reinterpret_cast<uint16_t*>(CallerBuffer(0).Get(Max(CeilDiv(a_lines * BS * job.wp, 2), 1)));
  job.bv = reinterpret_cast<uint16_t*>(CallerBuffer(1).Get(Max(CeilDiv(b_lines * l.out_inner * BS, 2), 1)));
  if (job.at == nullptr || job.bv == nullptr) return false;
  par.for_each(par.ctx, a_lines + b_lines, &WgradPackItem<BS>, &job);
  par.for_each(par.ctx, int64_t{p.cap} * l.taps, &WgradItem<BS>, &job);
  return true;
}

}  // namespace

bool RunConv(bool out_f32, const ConvParams& p, const Parallel& par) {
  ConvJob job{};
  job.p = &p;
  job.out_f32 = out_f32;
  job.nnz = SlotsInUse(p.nnz, p.cap);
  return ForTileBlockSize(p.bs, [&](auto bs) { return RunConvBlock<decltype(bs)::value>(job, par); });
}

bool WgradOnTiles(const ConvWgradParams& p) { return p.bs >= kMinBlock && UnitStepLines(p.g); }

bool RunConvWgrad(bool out_f32, const ConvWgradParams& p, const Parallel& par) {
  if (!WgradOnTiles(p)) return false;
  WgradJob job{};
  job.p = &p;
  job.out_f32 = out_f32;
  job.nnz = SlotsInUse(p.nnz, p.cap);
  return ForTileBlockSize(p.bs, [&](auto bs) { return RunWgradBlock<decltype(bs)::value>(job, par); });
}

}  // namespace bf16
}  // namespace cpu
}  // namespace jbs

#endif  // defined(JBS_CPU_BF16_KERNELS)
