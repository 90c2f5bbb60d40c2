// Launchers of the Hopper (sm_90a) block-sparse matmul kernels (declarations only; no
// CUDA device code, no CuTe: the FFI handlers include this file).
//
// The problems are the ones of the Ampere kernels (bsmm_problem.h): DSD for fprop and
// bprop, SDD for updat. The sm_90a kernels (bsmm_sm90_dsd.cuh, bsmm_sm90_dsd_packed.cuh,
// bsmm_sm90_sdd.cuh, bsmm_sm90_sdd_small.cuh) take 16-bit inputs (float16, bfloat16):
// DSD and SDD at every block size. Both also run float32 inputs on TF32 tensor cores when
// the caller asks for TF32 (LaunchDsdTF32, LaunchSddTF32), at the block sizes of
// bsmm_sm90_tf32.h (DSD not at block 8). Every
// other problem (exact float32) runs the Ampere kernels (bsmm_kernels.h),
// which also run on Hopper. Sm90Runs{Dsd,Sdd}{,TF32}() say which one a
// problem gets; they, the updat tiling and its workspace size live in the host-only
// bsmm_sm90_plan.h, which the Python binding shares.
//
// Like the Ampere launchers: a launch makes no CUDA call but the kernel launches and
// cudaGetLastError (TMA descriptors are encoded on the host, a pure host computation
// through the driver entry point); PrepareKernelsSm90() does the per-device setup
// outside stream capture.
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_H_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_H_

#include <cuda_runtime_api.h>

#include "bsmm_problem.h"
#include "sm90/bsmm_sm90_plan.h"
#include "sm90/bsmm_sm90_tf32.h"
#include "sm90/bsmm_sm90_variants.h"

namespace jbs {
namespace sm90 {

struct Launch {
  cudaStream_t stream = nullptr;
  bool prepare_only = false;  // launch nothing: set the kernel's attributes (PrepareKernelsSm90)
  int num_sms = 0;            // streaming multiprocessors of the device (persistent grid size)
  int plan_sms = 0;           // updat: the SM count its split plan assumes (<= num_sms; 0 = num_sms)
  void* workspace = nullptr;  // updat only: SddWorkspaceBytes(.., plan_sms) bytes, 16-byte aligned
};

// DSD (fprop; bprop with transpose_w). out_f32: float32 output, else the input dtype.
// `variant` (bsmm_sm90_variants.h) picks the kernel design; the stacked one needs the
// layout's work list in `p` (p.work, p.work_ptr) and runs where DsdVariantRuns says.
cudaError_t LaunchDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch,
                      DsdVariant variant = DsdVariant::kBaseline);

// DSD on TF32 tensor cores (float32 inputs at DEFAULT/HIGH precision, float32 output),
// the block sizes kDsdTF32BlockSizes (bsmm_sm90_tf32.h: 16/32 packed,
// bsmm_sm90_dsd_packed.cuh, and 64/128; not 8), no zero-sized dimension.
// TF32 GMMA reads B K-major only, so w is read as bprop reads it, w[s] viewed [n, k]: bprop passes w, fprop passes w
// with its blocks transposed (the lowering's jnp.swapaxes(w, -1, -2)); the tables of `p` say which product it is.
// Inputs are rounded towards zero to TF32 (10 mantissa bits) by the tensor cores; accumulation is float32.
cudaError_t LaunchDsdTF32(const DsdParams& p, const Launch& launch);

// SDD (updat).
cudaError_t LaunchSdd(DType in, bool out_f32, const SddParams& p, const Launch& launch);

// SDD on TF32 tensor cores (float32 inputs at DEFAULT/HIGH precision, float32 output),
// the block sizes kSddTF32BlockSizes (all: 8/16/32 in bsmm_sm90_sdd_small.cuh, same plan
// as 16-bit), n a positive
// multiple of kSddTF32RowMultiple (4), no zero-sized dimension. TF32 GMMA
// reads both operands K-major only, so p.x and p.dy hold x^T [cb * bs, n] and dy^T
// [kb * bs, n] (row-major; p.n, p.cb, p.kb are those of the product, as for LaunchSdd).
cudaError_t LaunchSddTF32(const SddParams& p, const Launch& launch);

// Per-dtype launchers (one translation unit each).
cudaError_t LaunchDsdBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdSmallBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdSmallF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdStackedBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdStackedF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdSmallTF32(const DsdParams& p, const Launch& launch);  // blocks 8/16/32
cudaError_t LaunchSddBF16(bool out_f32, const SddParams& p, const Launch& launch);
cudaError_t LaunchSddF16(bool out_f32, const SddParams& p, const Launch& launch);
cudaError_t LaunchSddSmallBF16(bool out_f32, const SddParams& p, const Launch& launch);
cudaError_t LaunchSddSmallF16(bool out_f32, const SddParams& p, const Launch& launch);
cudaError_t LaunchSddSmallTF32(const SddParams& p, const Launch& launch);  // blocks 8/16/32

// Sets every sm_90a kernel's shared memory limit on the current device (loading its
// module). Call once per device, never during stream capture.
cudaError_t PrepareKernelsSm90();

}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_H_
