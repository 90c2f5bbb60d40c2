// sm_90a SDD launchers (updat) for bf16 inputs: output bf16 or float32.
#include "sm90/bsmm_sm90_sdd.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchSddBF16(bool out_f32, const SddParams& p, const Launch& launch) {
  using T = cutlass::bfloat16_t;
  return out_f32 ? detail::DispatchSdd<T, float>(p, launch) : detail::DispatchSdd<T, T>(p, launch);
}

}  // namespace sm90
}  // namespace jbs
