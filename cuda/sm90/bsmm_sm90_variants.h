// The Hopper kernels' variants: which kernel a Hopper target runs for one product, in
// host-only code (no CUDA headers), shared by the launchers, the FFI handlers and the
// Python binding (module.cc: build_info()["sm90"]["variants"], which
// jax_blocksparse/ops/_sm90.py reads).
//
// A variant is a kernel design for a product, measured beside the others before it is
// chosen: the session bench times every variant in one process and writes the winner per
// (op, mode, block size, density range) into the crossover table; the lowering passes the
// chosen one as the v2 targets' `variant` attribute. Where no table names one, the
// baseline runs. The Hopper gate verifies each variant on its own key
// ("jbs_bsmm_fprop_sm90:stacked"), so verifying the baseline opens no other variant.
//
//   baseline  today's kernels (bsmm_sm90_dsd.cuh; bsmm_sm90_dsd_packed.cuh below block 64),
//             every problem the Hopper targets take.
//   stacked   DSD at blocks 8/16/32/64, 16-bit inputs (bsmm_sm90_dsd_stacked.cuh): a
//             tile's entries stacked along K (one per stage at block 64), wgmma N = BS,
//             no wasted MMA work, a ping-pong epilogue, row-tile-major order, the layout's
//             flat work list. fprop and bprop of the v2 targets.
//   capped    SDD (updat), every product: the same kernels with the N reduction split
//             into fewer pieces, so that the float32 partials fit kSddCappedWorkspaceBytes
//             and the reduce pass reads them back from L2 rather than HBM. The variant is
//             the workspace the lowering gives the target: the handler plans for as many
//             SMs as that workspace allows (SddPlanSmsWithin, bsmm_sm90_plan.h).
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_VARIANTS_H_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_VARIANTS_H_

#include <cstddef>
#include <cstring>

#include "bsmm_problem.h"
#include "sm90/bsmm_sm90_tf32.h"  // BlockSizeIn

namespace jbs {
namespace sm90 {

enum class DsdVariant { kBaseline = 0, kStacked = 1 };
constexpr const char* kDsdVariantNames[] = {"baseline", "stacked"};
constexpr int kNumDsdVariants = 2;

// Block sizes of the stacked DSD kernel (16-bit inputs). Not 128: a block is two stages of
// K there, which its tile does not split.
constexpr int kDsdStackedBlockSizes[] = {8, 16, 32, 64};

// Whether `variant` of the DSD kernels runs a product of `in` inputs (tf32: float32 on TF32
// tensor cores) at block size `bs`. The baseline runs every product of the targets.
inline bool DsdVariantRuns(DsdVariant variant, DType in, bool tf32, int bs) {
  switch (variant) {
    case DsdVariant::kBaseline: return true;
    case DsdVariant::kStacked:
      return !tf32 && (in == DType::kF16 || in == DType::kBF16) && BlockSizeIn(kDsdStackedBlockSizes, bs);
  }
  return false;
}

// SDD (updat) variants: see above.
enum class SddVariant { kBaseline = 0, kCapped = 1 };
constexpr const char* kSddVariantNames[] = {"baseline", "capped"};
constexpr int kNumSddVariants = 2;

// The capped variant's workspace: a third of the H100's 50 MB L2, so that the partials the
// split pass writes are still there when the reduce pass reads them.
constexpr size_t kSddCappedWorkspaceBytes = size_t{16} << 20;

// The variant named `name` ("baseline", "stacked"); false for another name.
inline bool ParseDsdVariant(const char* name, size_t size, DsdVariant* variant) {
  for (int v = 0; v < kNumDsdVariants; ++v) {
    if (std::strlen(kDsdVariantNames[v]) == size && std::strncmp(kDsdVariantNames[v], name, size) == 0) {
      *variant = static_cast<DsdVariant>(v);
      return true;
    }
  }
  return false;
}

}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_VARIANTS_H_
