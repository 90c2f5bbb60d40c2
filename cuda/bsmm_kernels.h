// Launchers of the block-sparse matmul kernels (declarations only).
//
// The problems (DsdParams for fprop/bprop, SddParams for updat) are described in
// bsmm_problem.h, shared with the CPU kernels; here every pointer is a device pointer.
// Every launcher enqueues its kernel(s) on `stream`, never allocates, synchronises or
// reads device memory on the host, and returns the error of the launch
// (cudaGetLastError) or cudaErrorInvalidValue for an unsupported configuration.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_KERNELS_H_
#define JAX_BLOCKSPARSE_CUDA_BSMM_KERNELS_H_

#include <cuda_runtime_api.h>

#include "bsmm_problem.h"

namespace jbs {

// DSD product. `transpose_w` selects bprop (W(s) = w[s]^T). `out_f32` selects a float32
// output; otherwise the output has the input dtype.
cudaError_t LaunchDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p,
                      cudaStream_t stream);

// SDD product (updat).
cudaError_t LaunchSdd(DType in, bool out_f32, const SddParams& p, cudaStream_t stream);

// Per-dtype launchers (one translation unit each, so the compile parallelises).
cudaError_t LaunchDsdF32(bool transpose_w, const DsdParams& p, cudaStream_t stream);
cudaError_t LaunchDsdF16(bool out_f32, bool transpose_w, const DsdParams& p, cudaStream_t stream);
cudaError_t LaunchDsdBF16(bool out_f32, bool transpose_w, const DsdParams& p, cudaStream_t stream);
cudaError_t LaunchSddF32(const SddParams& p, cudaStream_t stream);
cudaError_t LaunchSddF16(bool out_f32, const SddParams& p, cudaStream_t stream);
cudaError_t LaunchSddBF16(bool out_f32, const SddParams& p, cudaStream_t stream);

}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_KERNELS_H_
