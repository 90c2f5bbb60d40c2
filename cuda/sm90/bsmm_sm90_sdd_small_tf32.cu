// sm_90a SDD launcher (updat) for float32 inputs on TF32 tensor cores at blocks 8, 16 and
// 32 (slots stacked along wgmma's M, bsmm_sm90_sdd_small.cuh), float32 output. x and dy
// come transposed ([C, n], [K, n]).
#include "sm90/bsmm_sm90_sdd_small.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchSddSmallTF32(const SddParams& p, const Launch& launch) {
  return detail::DispatchSddSmallTF32(p, launch);
}

}  // namespace sm90
}  // namespace jbs
