// sm_90a SDD launcher (updat) for float32 inputs on TF32 tensor cores, float32 output.
// x and dy come transposed ([C, n], [K, n]; see bsmm_sm90_sdd.cuh).
#include "sm90/bsmm_sm90_sdd.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchSddTF32(const SddParams& p, const Launch& launch) {
  if (!launch.prepare_only && !Sm90RunsSddTF32(DType::kF32, p)) return cudaErrorInvalidValue;
  if (p.bs < 64) return LaunchSddSmallTF32(p, launch);  // bsmm_sm90_sdd_small_tf32.cu
  return detail::DispatchSddTF32(p, launch);
}

}  // namespace sm90
}  // namespace jbs
