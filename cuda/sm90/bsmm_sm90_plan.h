// What the Hopper (sm_90a) kernels run and how updat plans its work, in host-only code
// (no CUDA headers, no CuTe): which problems they take, the updat tiling, the SM count
// the updat workspace is sized for, and that workspace's size.
//
// One definition for every user: the launchers (bsmm_sm90_dispatch.cu and the kernel
// templates, through bsmm_sm90.h), the FFI handlers (bsmm_sm90_handlers.cc, which check
// the workspace they are given with SddWorkspaceBytes) and the Python binding (module.cc:
// build_info()["sm90"] and sm90_updat_workspace_bytes, which the lowering in
// jax_blocksparse/ops/_sm90.py sizes the workspace with). The binding holds these facts
// in every build, a CPU-only one too, so cross-lowering and the CPU tests see the same
// numbers as a GPU build.
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_PLAN_H_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_PLAN_H_

#include <cstddef>

#include "bsmm_block_sizes.h"
#include "bsmm_problem.h"
#include "bsmm_work_plan.h"
#include "sm90/bsmm_sm90_tf32.h"

namespace jbs {
namespace sm90 {

// The SM count the lowering sizes the updat workspace for: a device with more SMs plans
// its splits for this many (the handler halves its SM count until the workspace suffices).
constexpr int kPlanSms = 132;

// updat tiling: slots per work item and rows of N per k-step. Blocks 64/128: G
// accumulator tiles of BS x BS per item, 32 rows per step. Blocks 8/16/32
// (bsmm_sm90_sdd_small.cuh): 64 / bs slots stacked along wgmma's M = 64, 64 rows per step.
constexpr int SddGroupFor(int bs) { return bs == 128 ? 2 : (bs == 64 ? 4 : 64 / bs); }
constexpr int kSddTileK = 32;
constexpr int kSddSmallTileK = 64;
constexpr int SddTileKFor(int bs) { return bs >= 64 ? kSddTileK : kSddSmallTileK; }

// A TF32 updat reads x^T [C, n] and dy^T [K, n] through TMA, whose strides are multiples
// of 16 bytes: n must be a multiple of this (the lowering pads with zero rows).
constexpr int kSddTF32RowMultiple = 4;

inline bool Is16Bit(DType in) { return in == DType::kF16 || in == DType::kBF16; }

// Whether the sm_90a kernels run this problem (else the Ampere kernels do): 16-bit
// inputs, every supported block size (below 64 packed: bsmm_sm90_dsd_packed.cuh for DSD,
// bsmm_sm90_sdd_small.cuh for SDD), and no zero-sized dimension (a TMA descriptor needs
// positive extents).
inline bool Sm90RunsDsd(DType in, const DsdParams& p) {
  return Is16Bit(in) && SupportedBlockSize(p.bs) && p.n > 0 && p.nin > 0 && p.nseg > 0 && p.cap > 0;
}
inline bool Sm90RunsSdd(DType in, const SddParams& p) {
  return Is16Bit(in) && SupportedBlockSize(p.bs) && p.n > 0 && p.cb > 0 && p.kb > 0 && p.cap > 0;
}

// The same on TF32 tensor cores (float32 inputs the caller asked TF32 for): not every
// block size (bsmm_sm90_tf32.h says where TF32 is off, and why); for SDD, n a multiple of
// kSddTF32RowMultiple.
inline bool Sm90RunsDsdTF32(DType in, const DsdParams& p) {
  return in == DType::kF32 && DsdTF32Block(p.bs) && p.n > 0 && p.nin > 0 && p.nseg > 0 && p.cap > 0;
}
inline bool Sm90RunsSddTF32(DType in, const SddParams& p) {
  return in == DType::kF32 && SddTF32Block(p.bs) && p.n > 0 && p.n % kSddTF32RowMultiple == 0 && p.cb > 0 && p.kb > 0 &&
         p.cap > 0;
}

// Bytes of float32 partial sums the updat of `p` needs on a device with `num_sms` SMs
// (0 when the N reduction is not split, or the sm_90a kernels do not run `p`), for the
// 16-bit kernel or (tf32) the TF32 one. Depends on shapes only, never on the tables.
inline size_t SddWorkspaceBytes(DType in, const SddParams& p, int num_sms, bool tf32 = false) {
  if (!(tf32 ? Sm90RunsSddTF32(in, p) : Sm90RunsSdd(in, p))) return 0;
  // The TF32 kernel has the same slot groups and k-step (SddGroupFor, SddTileKFor): same plan.
  const plan::SddPlan pl =
      plan::MakeSddPlan(p.cap, SddGroupFor(p.bs), p.n, SddTileKFor(p.bs), num_sms > 0 ? num_sms : 1);
  return static_cast<size_t>(plan::SddWorkspaceElems(pl, p.bs)) * sizeof(float);
}

// The SM count an updat plans its splits for when its workspace holds `budget` bytes:
// `start` (the device's SM count, at most kPlanSms), halved until the workspace fits (fewer
// SMs never need more splits; 1 SM needs no split where there are two slot groups). The
// handler searches with the workspace it was given; the lowering sizes the capped
// variant's workspace with kSddCappedWorkspaceBytes and the same search from kPlanSms.
inline int SddPlanSmsWithin(DType in, const SddParams& p, size_t budget, bool tf32, int start = kPlanSms) {
  int sms = start < kPlanSms ? start : kPlanSms;
  while (sms > 1 && SddWorkspaceBytes(in, p, sms, tf32) > budget) sms /= 2;
  return sms;
}

}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_PLAN_H_
