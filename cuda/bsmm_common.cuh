// Device helpers shared by the bsmm kernels: PTX wrappers (cp.async, ldmatrix,
// mma.sync m16n8k16) and typed stores. sm_80 or newer.
//
// Fragment layouts used throughout (PTX ISA, "Matrix fragments for mma.m16n8k16"),
// with g = lane / 4 and q = lane % 4:
//   A (16 x 16, row major): a0 = A[g][2q..2q+1],   a1 = A[g+8][2q..2q+1],
//                           a2 = A[g][2q+8..+9],   a3 = A[g+8][2q+8..+9]
//   B (16 x 8):             b0 = B[2q..2q+1][g],   b1 = B[2q+8..+9][g]
//   C (16 x 8, f32):        c0,c1 = C[g][2q..2q+1], c2,c3 = C[g+8][2q..2q+1]
// ldmatrix.m8n8: lane l gives the address of row (l % 8) of matrix (l / 8); every lane
// receives row g, columns 2q..2q+1 of each matrix, or with .trans rows 2q..2q+1 of
// column g (that is, the transposed matrix's row g).
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_COMMON_CUH_
#define JAX_BLOCKSPARSE_CUDA_BSMM_COMMON_CUH_

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "bsmm_kernels.h"

namespace jbs {
namespace detail {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void Zero16(void* smem) { *reinterpret_cast<uint4*>(smem) = make_uint4(0u, 0u, 0u, 0u); }

__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p))
               : "memory");
}
__device__ __forceinline__ void Ldsm4T(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p))
               : "memory");
}
__device__ __forceinline__ void Ldsm2(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(SmemAddr(p))
               : "memory");
}
__device__ __forceinline__ void Ldsm2T(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(SmemAddr(p))
               : "memory");
}

// D += A * B, m16n8k16, float32 accumulators.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void Mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Stores two adjacent outputs (p is 2-element aligned: even column, even row stride).
__device__ __forceinline__ void Store2(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
__device__ __forceinline__ void Store2(__half* p, float x, float y) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}
__device__ __forceinline__ void Store2(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

__device__ __forceinline__ int Clamp(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Number of padding-free slots, read once per CTA from the device scalar.
__device__ __forceinline__ int LoadNnz(const int32_t* nnz, int cap) { return Clamp(__ldg(nnz), 0, cap); }

// Prepares `kernel` on the current device: loads its module (CUDA loads modules lazily,
// at a kernel's first use) and sets its dynamic shared memory limit (needed above
// 48 KiB; set always, so static + dynamic never hit the default limit). Per-device
// setup that must not run while a stream is being captured into a CUDA graph: only
// PrepareKernels() reaches it, from the handlers' initialize stage (bsmm_kernels.h).
template <typename Kernel>
inline cudaError_t PrepareKernel(Kernel kernel, int bytes) {
  // capture-unsafe: begin
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);  // loads the module
  if (err != cudaSuccess) return err;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  // capture-unsafe: end
}

}  // namespace detail
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_COMMON_CUH_
