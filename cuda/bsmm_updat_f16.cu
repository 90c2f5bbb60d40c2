// SDD launcher (updat) for f16 inputs: tensor cores, float32 accumulation, output
// f16 or float32.
#include "bsmm_sdd.cuh"

namespace jbs {

cudaError_t LaunchSddF16(bool out_f32, const SddParams& p, const Launch& launch) {
  using T = __half;
  return out_f32 ? detail::DispatchSddTc<T, float>(p, launch) : detail::DispatchSddTc<T, T>(p, launch);
}

}  // namespace jbs
