// sm_90a DSD launchers (fprop / bprop) for bf16 inputs: output bf16 or float32.
#include "sm90/bsmm_sm90_dsd.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchDsdBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch) {
  using T = cutlass::bfloat16_t;
  return out_f32 ? detail::DispatchDsd<T, float>(transpose_w, p, launch)
                 : detail::DispatchDsd<T, T>(transpose_w, p, launch);
}

}  // namespace sm90
}  // namespace jbs
