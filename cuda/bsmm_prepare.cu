// PrepareKernels: every kernel's per-device setup, done once per device before any
// CUDA-graph capture (see bsmm_kernels.h). It walks the same dispatch tables as the
// launches, with Launch::prepare_only, so no kernel a launch can select is missed.
#include <initializer_list>

#include "bsmm_block_sizes.h"
#include "bsmm_kernels.h"

namespace jbs {

cudaError_t PrepareKernels() {
  const Launch prepare{nullptr, true};
  for (int bs : kBlockSizes) {
    DsdParams dsd{};
    dsd.bs = bs;
    SddParams sdd{};
    sdd.bs = bs;
    // float32 inputs write float32 only; 16-bit inputs write their own dtype or float32.
    for (bool transpose_w : {false, true}) {
      if (cudaError_t err = LaunchDsd(DType::kF32, true, transpose_w, dsd, prepare); err != cudaSuccess) return err;
    }
    if (cudaError_t err = LaunchSdd(DType::kF32, true, sdd, prepare); err != cudaSuccess) return err;
    for (DType in : {DType::kF16, DType::kBF16}) {
      for (bool out_f32 : {false, true}) {
        for (bool transpose_w : {false, true}) {
          if (cudaError_t err = LaunchDsd(in, out_f32, transpose_w, dsd, prepare); err != cudaSuccess) return err;
        }
        if (cudaError_t err = LaunchSdd(in, out_f32, sdd, prepare); err != cudaSuccess) return err;
      }
    }
  }
  return cudaSuccess;
}

}  // namespace jbs
