// The geometry of the CPU convolution kernels (read bsconv_cpu.h first), shared by the
// per-instruction-set kernels (bsconv_cpu_kernels.cc) and the matrix-unit ones
// (bsconv_cpu_bf16.cc): output lines and their runs, the zero border of the packed input,
// and the (slot, tap) segments that feed one run of outputs.
//
// Like cpu_simd.h it needs JBS_CPU_ISA and defines everything inside that namespace with
// internal linkage: each instruction set's file gets its own copy, compiled with its
// flags (see bsmm_cpu.h for why nothing may be shared across them).
#ifndef JAX_BLOCKSPARSE_CUDA_CPU_BSCONV_RUNS_H_
#define JAX_BLOCKSPARSE_CUDA_CPU_BSCONV_RUNS_H_

#include <cstdint>
#include <vector>

#include "cpu/bsconv_cpu.h"
#include "cpu/cpu_simd.h"  // Min, Max, CeilDiv, CallerBuffer

#ifndef JBS_CPU_ISA
#error "bsconv_runs.h needs JBS_CPU_ISA (the namespace of this compilation's kernels)"
#endif

namespace jbs {
namespace cpu {
namespace JBS_CPU_ISA {
namespace {

// Spatial dims 0..nd-2 are "outer", nd-1 is the "inner" one. A line is one batch index
// and one outer output coordinate; its inner outputs o split into `phases` classes
// o = p + m * ostep (ostep = lhs_dilation / g, g = gcd(stride, lhs_dilation)), and
// within a class a tap that reads a real input at all reads inner positions
// i0 + m * istep (istep = stride / g).

int64_t Gcd(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

struct Lines {
  int nd;
  int64_t out_outer, in_outer;  // products of the outer output / input dims
  int64_t out_inner, in_inner;
  int64_t ostep, istep, phases;
  int64_t taps;     // all taps
  int64_t k_inner;  // taps of the inner dim
};

Lines MakeLines(const ConvGeometry& g) {
  Lines l{};
  l.nd = g.ndim;
  const int d = g.ndim - 1;
  l.out_outer = 1;
  l.in_outer = 1;
  l.taps = 1;
  for (int i = 0; i < g.ndim; ++i) l.taps *= g.kernel[i];
  for (int i = 0; i < d; ++i) {
    l.out_outer *= g.out[i];
    l.in_outer *= g.in[i];
  }
  l.out_inner = g.out[d];
  l.in_inner = g.in[d];
  const int64_t gcd = Gcd(g.stride[d], g.lhs_dilation[d]);
  l.ostep = g.lhs_dilation[d] / gcd;
  l.istep = g.stride[d] / gcd;
  l.phases = Min(l.ostep, Max(l.out_inner, 1));
  l.k_inner = g.kernel[d];
  return l;
}

// Outputs of phase p: p, p + ostep, ...
int64_t PhaseLength(const Lines& l, int64_t p) { return p < l.out_inner ? CeilDiv(l.out_inner - p, l.ostep) : 0; }

// Inner tap t at phase p reads inner input i0 + m * istep; false when it reads only zeros
// of the input dilation.
bool InnerStart(const ConvGeometry& g, int64_t p, int64_t t, int64_t* i0) {
  const int d = g.ndim - 1;
  const int64_t j = p * g.stride[d] + t * g.rhs_dilation[d] - g.pad_lo[d];
  if (j % g.lhs_dilation[d] != 0) return false;
  *i0 = j / g.lhs_dilation[d];
  return true;
}

// The outer input coordinates (flattened over the outer input dims) that outer tap
// `tap_outer` (flattened over the outer kernel dims) reads for outer output
// `o_outer`; false when that is padding or a zero of the input dilation.
bool OuterInput(const ConvGeometry& g, int64_t o_outer, int64_t tap_outer, int64_t* i_outer) {
  int64_t flat = 0;
  // Decode both multi-indices from the last outer dim to the first.
  int64_t o_rest = o_outer, t_rest = tap_outer, scale = 1;
  for (int d = g.ndim - 2; d >= 0; --d) {
    const int64_t o = o_rest % g.out[d], t = t_rest % g.kernel[d];
    o_rest /= g.out[d];
    t_rest /= g.kernel[d];
    const int64_t j = o * g.stride[d] + t * g.rhs_dilation[d] - g.pad_lo[d];
    if (j % g.lhs_dilation[d] != 0) return false;
    const int64_t i = j / g.lhs_dilation[d];
    if (i < 0 || i >= g.in[d]) return false;
    flat += i * scale;
    scale *= g.in[d];
  }
  *i_outer = flat;
  return true;
}

// OuterInput for every (outer output, outer tap), flattened [out_outer][k_outer]: the
// input's outer index, or -1. Made once per call: the work items look it up (the
// decoding divides, which would cost more than a short run's products).
std::vector<int64_t> OuterTable(const ConvGeometry& g, int64_t out_outer, int64_t k_outer) {
  std::vector<int64_t> table(static_cast<size_t>(out_outer * k_outer), -1);
  for (int64_t o = 0; o < out_outer; ++o) {
    for (int64_t t = 0; t < k_outer; ++t) {
      int64_t i;
      if (OuterInput(g, o, t, &i)) table[static_cast<size_t>(o * k_outer + t)] = i;
    }
  }
  return table;
}

// Outputs per work item at most (a run longer than this is split): the accumulator of
// a 16-bit output is kUnitRows x BS floats of thread scratch.
constexpr int64_t kUnitRows = 64;

// One run of outputs of a line: phase p, outputs p + (m0 + m) * ostep for m < len.
struct Unit {
  int64_t phase, m0, len;
};

// Marks a (phase, inner tap) that reads only zeros of the input dilation.
constexpr int64_t kNoInput = INT64_MIN;

// Every inner tap's first input per phase: tap_i0[ph * k_inner + t], or kNoInput where
// the tap reads only zeros of the input dilation.
void TapStarts(const ConvGeometry& g, const Lines& l, int64_t* tap_i0) {
  for (int64_t ph = 0; ph < l.phases; ++ph) {
    for (int64_t t = 0; t < l.k_inner; ++t) {
      int64_t i0;
      tap_i0[ph * l.k_inner + t] = InnerStart(g, ph, t, &i0) ? i0 : kNoInput;
    }
  }
}

// The runs of every line and what they read: inner input starts per (phase, inner tap)
// (tap_i0 [phases][k_inner], kNoInput for a dilation zero), the units of work, and the
// zero rows around each inner run of the packed input that the runs read beyond it.
struct ConvRuns {
  const int64_t* tap_i0;
  const Unit* units;
  int64_t num_units;
  int64_t pad_lo, pad_hi;
};

// Units of kUnitRows outputs per phase of a line.
int64_t CountUnits(const Lines& l) {
  int64_t num_units = 0;
  for (int64_t ph = 0; ph < l.phases; ++ph) num_units += CeilDiv(PhaseLength(l, ph), kUnitRows);
  return num_units;
}

// int64 words of storage PlanConvRuns needs.
int64_t ConvRunsWords(const Lines& l) { return l.phases * l.k_inner + 3 * CountUnits(l); }

// The plan of a convolution in `plan` (ConvRunsWords(l) words).
ConvRuns PlanConvRuns(const ConvGeometry& g, const Lines& l, int64_t* plan) {
  int64_t* tap_i0 = plan;
  Unit* units = reinterpret_cast<Unit*>(plan + l.phases * l.k_inner);
  ConvRuns runs{tap_i0, units, CountUnits(l), 0, 0};
  TapStarts(g, l, tap_i0);
  int64_t u = 0;
  for (int64_t ph = 0; ph < l.phases; ++ph) {
    const int64_t length = PhaseLength(l, ph);
    for (int64_t m0 = 0; m0 < length; m0 += kUnitRows) {
      units[u++] = Unit{ph, m0, Min(kUnitRows, length - m0)};
      // The zero border: what the runs that are not all padding read beyond the input.
      for (int64_t t = 0; t < l.k_inner; ++t) {
        const int64_t i0 = tap_i0[ph * l.k_inner + t];
        if (i0 == kNoInput || l.in_inner == 0) continue;
        const int64_t first = i0 + m0 * l.istep, last = first + (units[u - 1].len - 1) * l.istep;
        if (last < 0 || first >= l.in_inner) continue;
        runs.pad_lo = Max(runs.pad_lo, -first);
        runs.pad_hi = Max(runs.pad_hi, last - (l.in_inner - 1));
      }
    }
  }
  return runs;
}

// The longest segment list of any unit: the most slots of an output block times the taps.
int64_t MaxConvSegments(const ConvParams& p, const Lines& l) {
  int64_t longest = 0;
  for (int j = 0; j < p.nseg; ++j) {
    const int64_t e0 = Min(Max(p.seg_ptr[j], 0), p.cap);
    longest = Max(longest, Min(Max(p.seg_ptr[j + 1], e0), p.cap) - e0);
  }
  return Max(1, longest * l.taps);
}

// What a convolution call plans before its work items run (both kernels): its lines,
// their runs (in the calling thread's buffer 2), the outer table, the width of a run of
// the packed input with its zero border, and the longest segment list of a unit.
struct ConvPlan {
  Lines l;
  int64_t lines;  // n * out_outer
  ConvRuns runs;
  std::vector<int64_t> outer_in;  // [out_outer][k_outer] (OuterTable)
  int64_t wp;                     // pad_lo + in_inner + pad_hi
  int64_t max_segments;
};

// False when there is no memory for the runs.
bool MakeConvPlan(const ConvParams& p, ConvPlan* plan) {
  plan->l = MakeLines(p.g);
  const Lines& l = plan->l;
  plan->lines = p.n * l.out_outer;
  int64_t* words = reinterpret_cast<int64_t*>(CallerBuffer(2).Get(2 * ConvRunsWords(l) + 2));
  if (words == nullptr) return false;
  plan->runs = PlanConvRuns(p.g, l, words);
  plan->outer_in = OuterTable(p.g, l.out_outer, l.taps / l.k_inner);
  plan->wp = plan->runs.pad_lo + l.in_inner + plan->runs.pad_hi;
  plan->max_segments = MaxConvSegments(p, l);
  return true;
}

// A convolution work item: output block `seg` x unit `unit` of line (b, o_outer), whose
// outputs are rows row0, row0 + ostep, ... of the output.
struct ConvItemOf {
  int64_t seg, b, o_outer, row0;
  const Unit* unit;
};

// Work item `item` (output blocks in p.order, then lines, then units); false when p.order
// is not a permutation (the handler's contract is broken: the item does nothing).
bool DecodeConvItem(const ConvParams& p, const ConvPlan& plan, int64_t item, ConvItemOf* it) {
  const Lines& l = plan.l;
  const int64_t per_column = plan.lines * plan.runs.num_units;
  it->seg = p.order[item / per_column];
  if (it->seg < 0 || it->seg >= p.nseg) return false;
  const int64_t line = (item % per_column) / plan.runs.num_units;
  it->unit = &plan.runs.units[item % plan.runs.num_units];
  it->b = line / l.out_outer;
  it->o_outer = line % l.out_outer;
  const int64_t o_first = it->unit->phase + it->unit->m0 * l.ostep;  // first inner output
  it->row0 = (it->b * l.out_outer + it->o_outer) * l.out_inner + o_first;
  return true;
}

// The segments of unit `unit` of line (b, o_outer) in output block `seg`: every (slot, tap)
// whose input run is not all padding, as A[i] (the run's first input row in `packed`, rows
// istep * bs elements apart) and B[i] (the tap's weights). Returns their count. `packed` is
// the input as [nin][n][in_outer][wp][bs] with pad_lo zero rows before each inner run (the
// plan's), `weights` bs * bs elements per (slot, tap) at [slot][tap], both of type T.
template <typename T>
int64_t ListConvSegments(const ConvParams& p, const ConvPlan& plan, int64_t nnz, const T* packed, const T* weights,
                         int64_t seg, int64_t b, int64_t o_outer, const Unit& unit, const T** A, const T** B) {
  const Lines& l = plan.l;
  const int64_t bs = p.bs, wp = plan.wp;
  const int64_t* outer_in = plan.outer_in.data();
  int64_t count = 0;
  const int64_t e0 = Min(Max(p.seg_ptr[seg], 0), p.cap);
  const int64_t e1 = Min(Max(p.seg_ptr[seg + 1], e0), p.cap);
  const int64_t k_outer = l.taps / l.k_inner;
  const int64_t* i0s = plan.runs.tap_i0 + unit.phase * l.k_inner;
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t slot = p.seg_slots ? p.seg_slots[e] : e;
    if (slot < 0 || slot >= nnz) continue;  // padding
    const int64_t block = p.in_block[slot];
    if (block < 0 || block >= p.nin) continue;
    const T* image = packed + (block * p.n + b) * l.in_outer * wp * bs;
    for (int64_t to = 0; to < k_outer; ++to) {
      const int64_t i_outer = outer_in[o_outer * k_outer + to];
      if (i_outer < 0) continue;
      const T* run = image + i_outer * wp * bs;
      for (int64_t ti = 0; ti < l.k_inner; ++ti) {
        if (i0s[ti] == kNoInput) continue;
        const int64_t first = i0s[ti] + unit.m0 * l.istep;
        const int64_t last = first + (unit.len - 1) * l.istep;
        if (last < 0 || first >= l.in_inner) continue;  // all padding
        const int64_t tap = to * l.k_inner + ti;
        const int64_t wtap = p.transpose_kernel ? l.taps - 1 - tap : tap;
        A[count] = run + (plan.runs.pad_lo + first) * bs;
        B[count] = weights + (slot * l.taps + wtap) * bs * bs;
        ++count;
      }
    }
  }
  return count;
}

}  // namespace
}  // namespace JBS_CPU_ISA
}  // namespace cpu
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_CPU_BSCONV_RUNS_H_
