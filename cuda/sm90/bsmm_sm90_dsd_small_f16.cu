// sm_90a DSD launchers (fprop / bprop) for f16 inputs at blocks 8, 16 and 32
// (block-diagonal packing, bsmm_sm90_dsd_packed.cuh): output f16 or float32.
#include "sm90/bsmm_sm90_dsd_packed.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchDsdSmallF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch) {
  using T = cutlass::half_t;
  return out_f32 ? detail::DispatchDsdPacked<T, float>(transpose_w, p, launch)
                 : detail::DispatchDsdPacked<T, T>(transpose_w, p, launch);
}

}  // namespace sm90
}  // namespace jbs
