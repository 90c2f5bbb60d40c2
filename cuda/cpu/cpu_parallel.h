// The CPU handlers' work on XLA's intra-op thread pool (shared by the bsmm and bsconv
// handlers).
//
// A call is synchronous: it returns when every work item has run. The calling thread
// works too, and waits only for items already claimed by running workers, so a busy
// pool delays the call but cannot deadlock it.
#ifndef JAX_BLOCKSPARSE_CUDA_CPU_CPU_PARALLEL_H_
#define JAX_BLOCKSPARSE_CUDA_CPU_CPU_PARALLEL_H_

#include <cstdint>

#include "cpu/bsmm_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace jbs {
namespace cpu {

// Below this many multiply-adds a call runs on the calling thread alone: handing items
// to pool workers and waiting for them costs several microseconds per parallel step,
// more than such a call computes (bench/dispatch.py measures the host time of a call).
constexpr int64_t kSerialMacs = int64_t{1} << 20;

// The pool, or the calling thread alone for a call of `macs` multiply-adds.
Parallel Workers(xla::ffi::ThreadPool& pool, int64_t macs);

// The matrix units' multiply-adds per FMA multiply-add in the same time: a tile product
// (TDPBF16PS) does 16 x 16 x 32 per instruction, 512-bit FMA 16 per lane group.
constexpr int64_t kTileMacsPerFmaMac = 16;

// `par`, or the calling thread alone where its call's multiply-adds (par.macs) run on the
// matrix units: they weigh kTileMacsPerFmaMac times less than Workers assumed. A product
// of 256 x 512 with 6 blocks of 64 took 62 us on the pool and 47 us on the calling thread.
Parallel OnTiles(const Parallel& par);

// Advises huge pages for the 2 MiB-aligned interior of a result buffer of `bytes` that XLA
// allocated, where it holds at least two such pages. glibc maps a block of 32 MiB or more
// afresh for each allocation and unmaps it when freed, so such a result faults in every
// call: 4 KiB at a time, one fault per page written (8,192 for a 32 MiB result), unless
// the pages are huge. Advice only: where the kernel declines, nothing changes.
void AdviseHugePages(void* data, int64_t bytes);

}  // namespace cpu
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_CPU_CPU_PARALLEL_H_
