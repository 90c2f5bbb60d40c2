// DSD launchers (fprop, and bprop = fprop with swapped tables and w^T): float32 inputs
// (SIMT, float32 FMA) and the dtype dispatch. 16-bit inputs are in bsmm_fprop_{f16,bf16}.cu.
#include "bsmm_dsd.cuh"

namespace jbs {

cudaError_t LaunchDsdF32(bool transpose_w, const DsdParams& p, const Launch& launch) {
  return transpose_w ? detail::DispatchDsdF32<true>(p, launch) : detail::DispatchDsdF32<false>(p, launch);
}

cudaError_t LaunchDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch) {
  switch (in) {
    case DType::kF32: return out_f32 ? LaunchDsdF32(transpose_w, p, launch) : cudaErrorInvalidValue;
    case DType::kF16: return LaunchDsdF16(out_f32, transpose_w, p, launch);
    case DType::kBF16: return LaunchDsdBF16(out_f32, transpose_w, p, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jbs
