// sm_90a SDD launchers (updat) for bf16 inputs at blocks 8, 16 and 32 (slots stacked
// along wgmma's M, bsmm_sm90_sdd_small.cuh): output bf16 or float32.
#include "sm90/bsmm_sm90_sdd_small.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchSddSmallBF16(bool out_f32, const SddParams& p, const Launch& launch) {
  using T = cutlass::bfloat16_t;
  return out_f32 ? detail::DispatchSddSmall<T, float>(p, launch) : detail::DispatchSddSmall<T, T>(p, launch);
}

}  // namespace sm90
}  // namespace jbs
