// Launchers of the block-sparse matmul kernels (declarations only).
//
// Two kernel families cover the three primitives of jax_blocksparse/ops/matmul.py:
//
//   DSD (dense x sparse -> dense), used by fprop and by bprop with the tables swapped:
//     out[:, j-block] = sum over entries e of segment j of
//                       a[:, in_block[slot(e)]-block] @ W(slot(e))
//     fprop: segments = output block columns (col_ptr), slot(e) = e,
//            in_block = block_rows, W(s) = w[s]
//     bprop: segments = input block rows (row_ptr), slot(e) = row_slots[e],
//            in_block = block_cols, W(s) = w[s]^T
//   SDD (dense x dense -> sparse), used by updat:
//     dw[s] = x[:, block_rows[s]-block]^T @ dy[:, block_cols[s]-block], 0 for s >= nnz
//
// All pointers are device pointers. Every launcher enqueues its kernel(s) on `stream`,
// never allocates, synchronises or reads device memory on the host, and returns the
// error of the launch (cudaGetLastError) or cudaErrorInvalidValue for an unsupported
// configuration. Rows are int64 so N * features may exceed 2^31.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_KERNELS_H_
#define JAX_BLOCKSPARSE_CUDA_BSMM_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jbs {

// Element types of the float operands. Inputs share one type; the output is either the
// input type or float32 (accumulation is always float32).
enum class DType { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct DsdParams {
  const void* a;             // [n, nin * bs] dense lhs (x for fprop, g for bprop)
  const void* w;             // [cap, bs, bs] stored blocks
  void* out;                 // [n, nseg * bs] every element is written
  const int32_t* seg_ptr;    // [nseg + 1] entries of output block j: seg_ptr[j]:seg_ptr[j+1]
  const int32_t* seg_slots;  // [cap] entry -> slot; nullptr means slot == entry (fprop)
  const int32_t* in_block;   // [cap] slot -> input block index (< nin)
  const int32_t* order;      // [nseg] output blocks in the order CTAs visit them (a permutation)
  const int32_t* nnz;        // device scalar (col_ptr + KB): slots >= *nnz are padding
  int64_t n;                 // rows (product of the leading dims), >= 0
  int nin;                   // number of input blocks
  int nseg;                  // number of output blocks
  int cap;                   // capacity (number of slots)
  int bs;                    // block size: 8, 16, 32, 64 or 128
};

struct SddParams {
  const void* x;             // [n, cb * bs]
  const void* dy;            // [n, kb * bs]
  void* dw;                  // [cap, bs, bs] every element is written (0 at padding)
  const int32_t* block_rows; // [cap] input block row of each slot
  const int32_t* block_cols; // [cap] output block column of each slot
  const int32_t* nnz;        // device scalar (col_ptr + KB)
  int64_t n;
  int cb;
  int kb;
  int cap;
  int bs;
};

// Whether a (dtype, block size) pair has a compiled kernel.
bool SupportedBlockSize(int bs);

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
