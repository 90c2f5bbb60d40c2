// SDD launchers (updat): float32 inputs (SIMT, float32 FMA) and the dtype dispatch.
// 16-bit inputs are in bsmm_updat_{f16,bf16}.cu.
#include "bsmm_sdd.cuh"

namespace jbs {

cudaError_t LaunchSddF32(const SddParams& p, const Launch& launch) {
  switch (p.bs) {  // (block, rows x columns per thread)
    case 8: return detail::LaunchSddF32Tile<8, 1, 1>(p, launch);
    case 16: return detail::LaunchSddF32Tile<16, 1, 1>(p, launch);
    case 32: return detail::LaunchSddF32Tile<32, 2, 2>(p, launch);
    case 64: return detail::LaunchSddF32Tile<64, 4, 4>(p, launch);
    case 128: return detail::LaunchSddF32Tile<128, 8, 8>(p, launch);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchSdd(DType in, bool out_f32, const SddParams& p, const Launch& launch) {
  switch (in) {
    case DType::kF32: return out_f32 ? LaunchSddF32(p, launch) : cudaErrorInvalidValue;
    case DType::kF16: return LaunchSddF16(out_f32, p, launch);
    case DType::kBF16: return LaunchSddBF16(out_f32, p, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jbs
