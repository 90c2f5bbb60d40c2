// sm_90a DSD launchers (fprop / bprop) for bf16 inputs at blocks 8, 16 and 32
// (block-diagonal packing, bsmm_sm90_dsd_packed.cuh): output bf16 or float32.
#include "sm90/bsmm_sm90_dsd_packed.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchDsdSmallBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch) {
  using T = cutlass::bfloat16_t;
  return out_f32 ? detail::DispatchDsdPacked<T, float>(transpose_w, p, launch)
                 : detail::DispatchDsdPacked<T, T>(transpose_w, p, launch);
}

}  // namespace sm90
}  // namespace jbs
