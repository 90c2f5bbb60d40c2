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
// problem gets.
//
// Like the Ampere launchers: a launch makes no CUDA call but the kernel launches and
// cudaGetLastError (TMA descriptors are encoded on the host, a pure host computation
// through the driver entry point); PrepareKernelsSm90() does the per-device setup
// outside stream capture.
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_H_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_H_

#include <cstddef>

#include <cuda_runtime_api.h>

#include "bsmm_problem.h"
#include "sm90/bsmm_sm90_tf32.h"

namespace jbs {
namespace sm90 {

struct Launch {
  cudaStream_t stream = nullptr;
  bool prepare_only = false;  // launch nothing: set the kernel's attributes (PrepareKernelsSm90)
  int num_sms = 0;            // streaming multiprocessors of the device (persistent grid size)
  int plan_sms = 0;           // updat: the SM count its split plan assumes (<= num_sms; 0 = num_sms)
  void* workspace = nullptr;  // updat only: SddWorkspaceBytes(.., plan_sms) bytes, 16-byte aligned
};

// updat tiling (mirrored by jax_blocksparse/ops/_sm90.py for the workspace size):
// slots per work item and rows of N per k-step. Blocks 64/128: G accumulator tiles of
// BS x BS per item, 32 rows per step. Blocks 8/16/32 (bsmm_sm90_sdd_small.cuh): 64 / bs
// slots stacked along wgmma's M = 64, 64 rows per step.
constexpr int SddGroupFor(int bs) { return bs == 128 ? 2 : (bs == 64 ? 4 : 64 / bs); }
constexpr int kSddTileK = 32;
constexpr int kSddSmallTileK = 64;
constexpr int SddTileKFor(int bs) { return bs >= 64 ? kSddTileK : kSddSmallTileK; }

// Whether the sm_90a kernels run this problem (else the Ampere kernels do): 16-bit
// inputs, blocks 8..128 (below 64 packed: bsmm_sm90_dsd_packed.cuh for DSD,
// bsmm_sm90_sdd_small.cuh for SDD), and no zero-sized dimension (a TMA descriptor needs
// positive extents).
bool Sm90RunsDsd(DType in, const DsdParams& p);
bool Sm90RunsSdd(DType in, const SddParams& p);

// DSD (fprop; bprop with transpose_w). out_f32: float32 output, else the input dtype.
cudaError_t LaunchDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);

// DSD on TF32 tensor cores (float32 inputs at DEFAULT/HIGH precision, float32 output),
// the block sizes kDsdTF32BlockSizes (bsmm_sm90_tf32.h: 16/32 packed,
// bsmm_sm90_dsd_packed.cuh, and 64/128; not 8), no zero-sized dimension.
// TF32 GMMA reads B K-major only, so w is read as bprop reads it, w[s] viewed [n, k]: bprop passes w, fprop passes w with its
// blocks transposed (the lowering's jnp.swapaxes(w, -1, -2)); the tables of `p` say
// which product it is. Inputs are rounded towards zero to TF32 (10 mantissa bits) by the
// tensor cores; accumulation is float32.
bool Sm90RunsDsdTF32(DType in, const DsdParams& p);
cudaError_t LaunchDsdTF32(const DsdParams& p, const Launch& launch);

// Bytes of float32 partial sums the updat of `p` needs on a device with `num_sms` SMs
// (0 when the N reduction is not split), for the 16-bit kernel or (tf32) the TF32 one.
// Depends on shapes only, never on the tables.
size_t SddWorkspaceBytes(DType in, const SddParams& p, int num_sms, bool tf32 = false);

// SDD (updat).
cudaError_t LaunchSdd(DType in, bool out_f32, const SddParams& p, const Launch& launch);

// SDD on TF32 tensor cores (float32 inputs at DEFAULT/HIGH precision, float32 output),
// the block sizes kSddTF32BlockSizes (all: 8/16/32 in bsmm_sm90_sdd_small.cuh, same plan
// as 16-bit), n a positive
// multiple of 4, no zero-sized dimension. TF32 GMMA
// reads both operands K-major only, so p.x and p.dy hold x^T [cb * bs, n] and dy^T
// [kb * bs, n] (row-major; p.n, p.cb, p.kb are those of the product, as for LaunchSdd).
bool Sm90RunsSddTF32(DType in, const SddParams& p);
cudaError_t LaunchSddTF32(const SddParams& p, const Launch& launch);

// Per-dtype launchers (one translation unit each).
cudaError_t LaunchDsdBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdSmallBF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
cudaError_t LaunchDsdSmallF16(bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch);
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
