// sm_90a DSD launcher (fprop / bprop) for float32 inputs on TF32 tensor cores, float32
// output. The w operand is read K-major: bprop's w as it is, fprop's w with its blocks
// transposed by the lowering (see bsmm_sm90_dsd.cuh).
#include "sm90/bsmm_sm90_dsd.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchDsdTF32(const DsdParams& p, const Launch& launch) {
  if (!launch.prepare_only && !Sm90RunsDsdTF32(DType::kF32, p)) return cudaErrorInvalidValue;
  if (p.bs < 64) return LaunchDsdSmallTF32(p, launch);  // bsmm_sm90_dsd_small_tf32.cu
  return detail::DispatchDsdTF32(p, launch);
}

}  // namespace sm90
}  // namespace jbs
