// sm_90a DSD launcher (fprop / bprop) for float32 inputs on TF32 tensor cores at blocks
// 8, 16 and 32 (block-diagonal packing, bsmm_sm90_dsd_packed.cuh), float32 output. w is
// read K-major: bprop's w as it is, fprop's w with its blocks transposed by the lowering.
#include "sm90/bsmm_sm90_dsd_packed.cuh"

namespace jbs {
namespace sm90 {

cudaError_t LaunchDsdSmallTF32(const DsdParams& p, const Launch& launch) {
  return detail::DispatchDsdPackedTF32(p, launch);
}

}  // namespace sm90
}  // namespace jbs
