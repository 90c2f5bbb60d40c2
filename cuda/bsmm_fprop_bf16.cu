// DSD launchers (fprop / bprop) for bf16 inputs: tensor cores, float32 accumulation,
// output bf16 or float32.
#include "bsmm_dsd.cuh"

namespace jbs {

cudaError_t LaunchDsdBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch) {
  using T = __nv_bfloat16;
  if (out_f32) {
    return transpose_w ? detail::DispatchDsdTc<T, float, true>(p, launch)
                       : detail::DispatchDsdTc<T, float, false>(p, launch);
  }
  return transpose_w ? detail::DispatchDsdTc<T, T, true>(p, launch) : detail::DispatchDsdTc<T, T, false>(p, launch);
}

}  // namespace jbs
