// Launchers of the block-sparse matmul kernels (declarations only).
//
// The problems (DsdParams for fprop/bprop, SddParams for updat) are described in
// bsmm_problem.h, shared with the CPU kernels; here every pointer is a device pointer.
// Every launcher enqueues its kernel(s) on `launch.stream`, never allocates,
// synchronises or reads device memory on the host, and returns the error of the launch
// (cudaGetLastError) or cudaErrorInvalidValue for an unsupported configuration.
//
// CUDA graphs: XLA records larger programs into CUDA graphs by stream capture, during
// which per-device setup calls (module loading, cudaFuncSetAttribute, cudaSetDevice)
// fail. So launching is split in two: PrepareKernels() does every kernel's setup once
// per device, before any capture (the handlers' initialize stage); a launch then makes
// no CUDA call but the launch itself and cudaGetLastError.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_KERNELS_H_
#define JAX_BLOCKSPARSE_CUDA_BSMM_KERNELS_H_

#include <cuda_runtime_api.h>

#include "bsmm_problem.h"

namespace jbs {

// What a launcher does with the kernel it selects.
struct Launch {
  cudaStream_t stream = nullptr;  // where the kernel is enqueued
  bool prepare_only = false;      // launch nothing: prepare the kernel (PrepareKernels)
};

// Prepares every kernel of the library on the current device (loads it, sets its
// shared memory limit). Call once per device, never during stream capture.
cudaError_t PrepareKernels();

// DSD product. `transpose_w` selects bprop (W(s) = w[s]^T). `out_f32` selects a float32
// output; otherwise the output has the input dtype.
cudaError_t LaunchDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);

// SDD product (updat).
cudaError_t LaunchSdd(DType in, bool out_f32, const SddParams& p, const Launch& launch);

// Per-dtype launchers (one translation unit each, so the compile parallelises).
cudaError_t LaunchDsdF32(bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchSddF32(const SddParams& p, const Launch& launch);
cudaError_t LaunchSddF16(bool out_f32, const SddParams& p, const Launch& launch);
cudaError_t LaunchSddBF16(bool out_f32, const SddParams& p, const Launch& launch);

}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_KERNELS_H_
