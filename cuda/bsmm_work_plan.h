// The work plan of the persistent bsmm kernels: which tile a CTA computes, as data.
//
// A persistent kernel launches about one CTA per SM and each CTA loops
//
//     for (int64_t t = blockIdx.x; t < NumItems(plan); t += gridDim.x) { item = ItemAt(plan, t); ... }
//
// Everything that decides coverage (which output tile, which reduction range, which
// layout entries) is a pure function of the plan and the layout tables, here, shared by
// the device code and the host. The host side is bound into the Python extension
// (module.cc: `_jbs_kernels.work_plan_dsd` / `work_plan_sdd`), so CI checks on a CPU that
// every output tile is written exactly once and every reduction split covers its range
// (tests/test_work_plan.py). A GPU run then only has to check the arithmetic.
//
// DSD (fprop, and bprop over the transposed tables; see bsmm_problem.h):
//   the output is [rows, num_outputs * bs]. An item is (m_tile, group): rows
//   [m_tile * tile_m, min(rows, (m_tile + 1) * tile_m)) of the outputs
//   order[group * pack + p], p < GroupSize(group). `order` is the layout's col_order or
//   row_order (longest segment first), so groups come longest first and the members of
//   a group have similar lengths; small blocks pack several outputs into one tile
//   (pack = 64 / bs) to reach the N >= 64 shapes wgmma is efficient at. Items are
//   group-major: the first wave of CTAs takes the longest outputs. Step s of member p
//   reads layout entry seg_ptr[out] + s when s < that output's length; an output of
//   length 0 is written as zeros.
//
// SDD (updat): the output is [capacity, bs, bs]. An item is (slot group, split): slots
//   [g * group, min(capacity, (g + 1) * group)) reduced over rows [n_begin, n_end). The
//   reduction over n is split when there are fewer slot groups than two per SM: split s
//   writes float32 partials to workspace[s] and a second pass sums the splits in index
//   order (deterministic). Slots >= nnz are padding and get zeros. Slots are in storage
//   order (column-major), so a slot group's slots mostly share one output column and its
//   dy tile.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_WORK_PLAN_H_
#define JAX_BLOCKSPARSE_CUDA_BSMM_WORK_PLAN_H_

#include <cstdint>

#if defined(__CUDACC__)
#define JBS_HD __host__ __device__ __forceinline__
#else
#define JBS_HD inline
#endif

namespace jbs {
namespace plan {

JBS_HD int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
JBS_HD int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
JBS_HD int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

// CTAs of a persistent launch: one wave of `ctas_per_sm` per SM, never more than there
// are items, and at least one (an empty problem still launches to write zeros).
JBS_HD int32_t PersistentGrid(int64_t items, int32_t num_sms, int32_t ctas_per_sm) {
  return static_cast<int32_t>(Max64(1, Min64(items, int64_t{num_sms} * ctas_per_sm)));
}

// Outputs per DSD tile for block size bs: small blocks are packed so that a tile's
// width reaches 64 columns.
JBS_HD int32_t DsdPackFor(int32_t bs) { return bs >= 64 ? 1 : 64 / bs; }

// ---------------------------------------------------------------------------------
// DSD
// ---------------------------------------------------------------------------------

struct DsdPlan {
  int64_t rows;         // leading rows of the dense operand, >= 0
  int32_t tile_m;       // rows per tile, > 0
  int32_t m_tiles;      // ceil(rows / tile_m), at least 1 (so empty-row problems still cover outputs)
  int32_t num_outputs;  // output blocks (segments), >= 0
  int32_t pack;         // outputs per tile, >= 1
  int32_t groups;       // ceil(num_outputs / pack)
};

struct DsdItem {
  int32_t m_tile;
  int32_t group;
};

JBS_HD DsdPlan MakeDsdPlan(int64_t rows, int32_t tile_m, int32_t num_outputs, int32_t pack) {
  DsdPlan p;
  p.rows = rows;
  p.tile_m = tile_m;
  p.m_tiles = static_cast<int32_t>(Max64(1, CeilDiv(rows, tile_m)));
  p.num_outputs = num_outputs;
  p.pack = pack;
  p.groups = static_cast<int32_t>(CeilDiv(num_outputs, pack));
  return p;
}

JBS_HD int64_t DsdNumItems(const DsdPlan& p) { return int64_t{p.m_tiles} * p.groups; }

JBS_HD DsdItem DsdItemAt(const DsdPlan& p, int64_t item) {
  DsdItem it;
  it.group = static_cast<int32_t>(item / p.m_tiles);
  it.m_tile = static_cast<int32_t>(item % p.m_tiles);
  return it;
}

JBS_HD int64_t DsdRowBegin(const DsdPlan& p, const DsdItem& it) { return int64_t{it.m_tile} * p.tile_m; }
JBS_HD int64_t DsdRowEnd(const DsdPlan& p, const DsdItem& it) { return Min64(p.rows, DsdRowBegin(p, it) + p.tile_m); }

// Members of a group: pack, except for the last group.
JBS_HD int32_t DsdGroupSize(const DsdPlan& p, int32_t group) {
  return static_cast<int32_t>(Min64(p.pack, int64_t{p.num_outputs} - int64_t{group} * p.pack));
}

// Output block written by member `member` of `group`.
JBS_HD int32_t DsdOutput(const DsdPlan& p, const int32_t* order, int32_t group, int32_t member) {
  return order[group * p.pack + member];
}

// Entries of output `out` (its segment length).
JBS_HD int32_t DsdLength(const int32_t* seg_ptr, int32_t out) { return seg_ptr[out + 1] - seg_ptr[out]; }

// k-steps a group's tile runs: its longest member's length (members beyond their own
// length skip the step).
JBS_HD int32_t DsdGroupSteps(const DsdPlan& p, const int32_t* seg_ptr, const int32_t* order, int32_t group) {
  int32_t steps = 0;
  for (int32_t m = 0; m < DsdGroupSize(p, group); ++m) {
    int32_t len = DsdLength(seg_ptr, DsdOutput(p, order, group, m));
    steps = len > steps ? len : steps;
  }
  return steps;
}

// Layout entry read by `member` at `step`, or -1 when the member has no entry there.
JBS_HD int32_t DsdEntry(const DsdPlan& p, const int32_t* seg_ptr, const int32_t* order, int32_t group, int32_t member,
                        int32_t step) {
  int32_t out = DsdOutput(p, order, group, member);
  return step < DsdLength(seg_ptr, out) ? seg_ptr[out] + step : -1;
}

// ---------------------------------------------------------------------------------
// DSD, stacked (the Hopper "stacked" variant at blocks 8, 16, 32)
// ---------------------------------------------------------------------------------
//
// One output per tile (a plan of pack 1: group q is the q-th output visited, order[q]),
// its entries stacked along K: step s reads the `depth` = 64 / bs consecutive entries
// work_ptr[q] + s * depth + member of the layout's flat work list, each an (input block,
// slot) pair, so that one wgmma of N = bs multiplies `depth` input slices by their
// blocks at once. Members past the segment's end read nothing (zeros).
//
// Items are row-tile-major (DsdStackedItemAt): a wave of CTAs takes the outputs of one or
// two row tiles, longest first, so the [tile_m, C] rows of the dense operand they all
// read stay in L2 and come from HBM once (group-major order, DsdItemAt, sweeps every row
// tile per output and re-reads them from HBM once L2 no longer holds them).
JBS_HD DsdItem DsdStackedItemAt(const DsdPlan& p, int64_t item) {
  DsdItem it;
  const int64_t groups = p.groups > 0 ? p.groups : 1;
  it.m_tile = static_cast<int32_t>(item / groups);
  it.group = static_cast<int32_t>(item % groups);
  return it;
}

// Entries of the q-th output visited: [begin, end) of the work list, clamped to [0, cap]
// (the tables are data: a corrupt pointer must not make a kernel read past the list).
struct StackedRange {
  int32_t begin;
  int32_t end;
};

JBS_HD int32_t ClampIndex(int32_t v, int32_t lo, int32_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

JBS_HD StackedRange DsdStackedRange(const int32_t* work_ptr, int32_t cap, int32_t q) {
  StackedRange r;
  r.begin = ClampIndex(work_ptr[q], 0, cap);
  r.end = ClampIndex(work_ptr[q + 1], r.begin, cap);
  return r;
}

// k-steps of a stacked tile: ceil(length / depth).
JBS_HD int32_t DsdStackedSteps(const StackedRange& r, int32_t depth) {
  return static_cast<int32_t>(CeilDiv(r.end - r.begin, depth));
}

// Work-list entry read by `member` (< depth) at `step`, or -1 past the segment's end.
JBS_HD int32_t DsdStackedEntry(const StackedRange& r, int32_t depth, int32_t step, int32_t member) {
  int64_t e = int64_t{r.begin} + int64_t{step} * depth + member;
  return e < r.end ? static_cast<int32_t>(e) : -1;
}

// ---------------------------------------------------------------------------------
// SDD
// ---------------------------------------------------------------------------------

struct SddPlan {
  int32_t capacity;     // slots to write (padding included)
  int32_t group;        // slots per item, >= 1
  int32_t slot_groups;  // ceil(capacity / group)
  int64_t n;            // rows reduced over, >= 0
  int32_t tile_n;       // rows per k-step, > 0
  int32_t splits;       // reduction splits, >= 1; 1 = no workspace
  int64_t split_len;    // rows per split, a multiple of tile_n
};

struct SddItem {
  int32_t slot_begin;
  int32_t slot_end;
  int64_t n_begin;
  int64_t n_end;
  int32_t split;
};

// Splits n only when the slot groups alone would leave SMs idle (fewer than two per
// SM), and never into more pieces than there are k-steps; no split is empty, every
// split but the last has the same length.
JBS_HD SddPlan MakeSddPlan(int32_t capacity, int32_t group, int64_t n, int32_t tile_n, int32_t num_sms) {
  SddPlan p;
  p.capacity = capacity;
  p.group = group;
  p.slot_groups = static_cast<int32_t>(CeilDiv(capacity, group));
  p.n = n;
  p.tile_n = tile_n;
  int64_t k_tiles = Max64(1, CeilDiv(n, tile_n));
  int64_t target = 2 * int64_t{num_sms};
  int64_t want = p.slot_groups >= target || p.slot_groups == 0 ? 1 : CeilDiv(target, p.slot_groups);
  int64_t splits = Min64(want, k_tiles);
  // Rounded so that there are at least `splits` pieces after re-counting.
  int64_t tiles_per_split = Max64(1, k_tiles / splits);
  p.split_len = tiles_per_split * tile_n;
  p.splits = static_cast<int32_t>(CeilDiv(k_tiles, tiles_per_split));
  return p;
}

JBS_HD int64_t SddNumItems(const SddPlan& p) { return int64_t{p.slot_groups} * p.splits; }

JBS_HD SddItem SddItemAt(const SddPlan& p, int64_t item) {
  SddItem it;
  int32_t g = static_cast<int32_t>(item / p.splits);
  it.split = static_cast<int32_t>(item % p.splits);
  it.slot_begin = g * p.group;
  it.slot_end = static_cast<int32_t>(Min64(p.capacity, int64_t{it.slot_begin} + p.group));
  it.n_begin = Min64(p.n, it.split * p.split_len);
  it.n_end = Min64(p.n, it.n_begin + p.split_len);
  return it;
}

// float32 elements of the split-reduction workspace: [splits, capacity, bs, bs], none
// when the reduction is not split.
JBS_HD int64_t SddWorkspaceElems(const SddPlan& p, int32_t bs) {
  return p.splits > 1 ? int64_t{p.splits} * p.capacity * bs * bs : 0;
}

}  // namespace plan
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_WORK_PLAN_H_
