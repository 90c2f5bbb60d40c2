// DSD launchers (fprop / bprop) for f16 inputs: tensor cores, float32 accumulation,
// output f16 or float32.
#include "bsmm_dsd.cuh"

namespace jbs {

cudaError_t LaunchDsdF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch) {
  using T = __half;
  if (out_f32) {
    return transpose_w ? detail::DispatchDsdTc<T, float, true>(p, launch)
                       : detail::DispatchDsdTc<T, float, false>(p, launch);
  }
  return transpose_w ? detail::DispatchDsdTc<T, T, true>(p, launch) : detail::DispatchDsdTc<T, T, false>(p, launch);
}

}  // namespace jbs
