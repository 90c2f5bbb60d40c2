// SDD launcher (updat) for bf16 inputs: tensor cores, float32 accumulation, output
// bf16 or float32.
#include "bsmm_sdd.cuh"

namespace jbs {

cudaError_t LaunchSddBF16(bool out_f32, const SddParams& p, const Launch& launch) {
  using T = __nv_bfloat16;
  return out_f32 ? detail::DispatchSddTc<T, float>(p, launch) : detail::DispatchSddTc<T, T>(p, launch);
}

}  // namespace jbs
