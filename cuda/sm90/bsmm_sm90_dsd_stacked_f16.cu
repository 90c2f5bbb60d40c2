// sm_90a DSD launchers (fprop / bprop), the "stacked" variant, for f16 inputs at blocks
// 8, 16, 32 and 64 (bsmm_sm90_dsd_stacked.cuh): output f16 or float32.
#include "sm90/bsmm_sm90_dsd_stacked.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchDsdStackedF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch) {
  using T = cutlass::half_t;
  return out_f32 ? detail::DispatchDsdStacked<T, float>(transpose_w, p, launch)
                 : detail::DispatchDsdStacked<T, T>(transpose_w, p, launch);
}

}  // namespace sm90
}  // namespace jbs
