// sm_90a launchers: dtype dispatch and per-device preparation. No CuTe here (the
// kernels live in the per-dtype translation units); which problems they run and the
// updat workspace size are in bsmm_sm90_plan.h.
#include <initializer_list>

#include "bsmm_block_sizes.h"
#include "sm90/bsmm_sm90.h"

namespace jbs {
namespace sm90 {

cudaError_t LaunchDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch,
                      DsdVariant variant) {
  if (!launch.prepare_only && !Sm90RunsDsd(in, p)) return cudaErrorInvalidValue;
  if (!DsdVariantRuns(variant, in, false, p.bs)) return cudaErrorInvalidValue;
  if (variant == DsdVariant::kStacked) {
    return in == DType::kF16 ? LaunchDsdStackedF16(out_f32, transpose_w, p, launch)
                             : LaunchDsdStackedBF16(out_f32, transpose_w, p, launch);
  }
  if (p.bs < 64) {
    return in == DType::kF16 ? LaunchDsdSmallF16(out_f32, transpose_w, p, launch)
                             : LaunchDsdSmallBF16(out_f32, transpose_w, p, launch);
  }
  return in == DType::kF16 ? LaunchDsdF16(out_f32, transpose_w, p, launch)
                           : LaunchDsdBF16(out_f32, transpose_w, p, launch);
}

cudaError_t LaunchSdd(DType in, bool out_f32, const SddParams& p, const Launch& launch) {
  if (!launch.prepare_only && !Sm90RunsSdd(in, p)) return cudaErrorInvalidValue;
  if (p.bs < 64) {
    return in == DType::kF16 ? LaunchSddSmallF16(out_f32, p, launch) : LaunchSddSmallBF16(out_f32, p, launch);
  }
  return in == DType::kF16 ? LaunchSddF16(out_f32, p, launch) : LaunchSddBF16(out_f32, p, launch);
}

cudaError_t PrepareKernelsSm90() {
  Launch prepare;
  prepare.prepare_only = true;
  for (int bs : kBlockSizes) {
    DsdParams dsd{};
    dsd.bs = bs;
    SddParams sdd{};
    sdd.bs = bs;
    // float32 on TF32 tensor cores, where it is on (bsmm_sm90_tf32.h)
    if (DsdTF32Block(bs)) {
      if (cudaError_t err = LaunchDsdTF32(dsd, prepare); err != cudaSuccess) return err;
    }
    if (SddTF32Block(bs)) {
      if (cudaError_t err = LaunchSddTF32(sdd, prepare); err != cudaSuccess) return err;
    }
    for (DType in : {DType::kF16, DType::kBF16}) {
      for (bool out_f32 : {false, true}) {
        for (bool transpose_w : {false, true}) {
          for (int v = 0; v < kNumDsdVariants; ++v) {
            const auto variant = static_cast<DsdVariant>(v);
            if (!DsdVariantRuns(variant, in, false, bs)) continue;
            if (cudaError_t err = LaunchDsd(in, out_f32, transpose_w, dsd, prepare, variant); err != cudaSuccess) {
              return err;
            }
          }
        }
        if (cudaError_t err = LaunchSdd(in, out_f32, sdd, prepare); err != cudaSuccess) return err;
      }
    }
  }
  return cudaSuccess;
}

}  // namespace sm90
}  // namespace jbs
