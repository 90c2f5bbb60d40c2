// What a bsmm kernel sees: the problem descriptions shared by the CPU and CUDA kernels.
//
// Plain structs only (no inline functions, no CUDA or XLA headers), so that every
// translation unit can include this header, including the CPU kernels compiled once
// per instruction set (see cuda/cpu/bsmm_cpu.h).
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
// Pointers are in the memory of the platform that runs the kernel (host for CPU, device
// for CUDA). Rows are int64 so that N * features may exceed 2^31.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_PROBLEM_H_
#define JAX_BLOCKSPARSE_CUDA_BSMM_PROBLEM_H_

#include <cstdint>

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
  const int32_t* order;      // [nseg] output blocks in the order workers visit them (a permutation)
  const int32_t* nnz;        // scalar (col_ptr + KB): slots >= *nnz are padding
  // The layout's flat work list (jax_blocksparse/layout.py: col_work / row_work and their
  // pointers), or nullptr where the target does not take it (the portable targets and
  // the Hopper targets' v1): pairs (input block, slot) in visiting order, and where the
  // q-th output visited (order[q]) starts in them. The Hopper v2 targets pass both.
  const int32_t* work;      // [2 * cap]
  const int32_t* work_ptr;  // [nseg + 1]
  int64_t n;                // rows (product of the leading dims), >= 0
  int nin;                  // number of input blocks
  int nseg;                 // number of output blocks
  int cap;                  // capacity (number of slots)
  int bs;                   // block size: one of kBlockSizes (bsmm_block_sizes.h)
};

struct SddParams {
  const void* x;              // [n, cb * bs]
  const void* dy;             // [n, kb * bs]
  void* dw;                   // [cap, bs, bs] every element is written (0 at padding)
  const int32_t* block_rows;  // [cap] input block row of each slot
  const int32_t* block_cols;  // [cap] output block column of each slot
  const int32_t* nnz;         // scalar (col_ptr + KB)
  int64_t n;
  int cb;
  int kb;
  int cap;
  int bs;
};

}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_PROBLEM_H_
