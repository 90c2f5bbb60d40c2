// XLA FFI handlers of the bsmm custom calls on CPU: the shared checks, then the kernels
// on XLA's intra-op thread pool.
//
// Same targets, operands and checks as on CUDA (bsmm_checks.h). The handlers are
// synchronous: they return when every work item has run. The calling thread works too,
// and waits only for items already claimed by running workers, so a busy pool delays
// the call but cannot deadlock it.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "bsmm_checks.h"
#include "cpu/bsmm_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbs {
namespace {

// Work shared by the caller and the pool tasks. Tasks that start after every item is
// claimed touch only this state (kept alive by their shared_ptr), never the job.
struct Work {
  int64_t count;
  void (*body)(void*, int64_t);
  void* arg;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Run() {
    int64_t finished = 0;
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      body(arg, i);
      ++finished;
    }
    if (finished > 0 && done.fetch_add(finished) + finished == count) {
      std::lock_guard<std::mutex> lock(mu);
      all_done.notify_all();
    }
  }
};

void ForEachOnPool(void* ctx, int64_t count, void (*body)(void*, int64_t), void* arg) {
  auto& pool = *static_cast<ffi::ThreadPool*>(ctx);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < count; ++i) body(arg, i);
    return;
  }
  auto work = std::make_shared<Work>();
  work->count = count;
  work->body = body;
  work->arg = arg;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Run(); });
  work->Run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() == count; });
}

void ForEachHere(void*, int64_t count, void (*body)(void*, int64_t), void* arg) {
  for (int64_t i = 0; i < count; ++i) body(arg, i);
}

// Below this many multiply-adds a call runs on the calling thread alone: handing items
// to pool workers and waiting for them costs several microseconds per parallel step,
// more than such a call computes (bench/dispatch.py measures the host time of a call).
constexpr int64_t kSerialMacs = int64_t{1} << 20;

// The pool, or the calling thread alone for a call of `macs` multiply-adds.
cpu::Parallel Workers(ffi::ThreadPool& pool, int64_t macs) {
  if (macs < kSerialMacs) return cpu::Parallel{nullptr, 1, &ForEachHere};
  return cpu::Parallel{&pool, static_cast<int>(std::max<int64_t>(1, pool.num_threads())), &ForEachOnPool};
}

// Multiply-adds of a checked problem: rows x blocks present x bs^2 (the tables are in
// host memory on CPU, so the block count can be read here).
int64_t Macs(int64_t rows, const int32_t* nnz, int cap, int bs) {
  const int64_t blocks = std::min<int64_t>(std::max<int32_t>(*nnz, 0), cap);
  return rows * blocks * bs * bs;
}

ffi::Error Unsupported(const char* op, const Operands& shapes) {
  return ffi::Error::Internal(std::string(op) + ": no CPU kernel for this block size, or no memory for its scratch buffers; " +
                              shapes.str());
}

ffi::Error DsdImpl(const char* op, bool transpose, ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer w,
                   ffi::AnyBuffer block_rows, ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr,
                   ffi::AnyBuffer row_ptr, ffi::AnyBuffer row_slots, ffi::AnyBuffer order,
                   ffi::Result<ffi::AnyBuffer> out) {
  KernelDtypes dt;
  DsdParams p;
  if (ffi::Error e = CheckDsd(op, transpose, a, w, block_rows, block_cols, col_ptr, row_ptr, row_slots,
                              order, *out, &dt, &p);
      e.failure()) {
    return e;
  }
  if (IsEmpty(p)) return ffi::Error::Success();
  if (!cpu::RunDsd(dt.in, dt.out_f32, transpose, p, Workers(pool, Macs(p.n, p.nnz, p.cap, p.bs)))) {
    return Unsupported(op, DescribeDsd(a, w, *out));
  }
  return ffi::Error::Success();
}

ffi::Error FpropImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> y) {
  return DsdImpl("jbs_bsmm_fprop", false, pool, x, w, block_rows, block_cols, col_ptr, row_ptr, row_slots,
                 order, y);
}

ffi::Error BpropImpl(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> dx) {
  return DsdImpl("jbs_bsmm_bprop", true, pool, g, w, block_rows, block_cols, col_ptr, row_ptr, row_slots,
                 order, dx);
}

ffi::Error UpdatImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::Result<ffi::AnyBuffer> dw) {
  const char* op = "jbs_bsmm_updat";
  KernelDtypes dt;
  SddParams p;
  if (ffi::Error e = CheckSdd(op, x, dy, block_rows, block_cols, col_ptr, row_ptr, row_slots, *dw, &dt, &p);
      e.failure()) {
    return e;
  }
  if (IsEmpty(p)) return ffi::Error::Success();
  if (!cpu::RunSdd(dt.in, dt.out_f32, p, Workers(pool, Macs(p.n, p.nnz, p.cap, p.bs)))) {
    return Unsupported(op, DescribeSdd(x, dy, *dw));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jbs

// Bindings: the shared operand lists (bsmm_checks.h) after XLA's intra-op thread pool.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmFpropCpu, jbs::FpropImpl, jbs::BindDsd<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmBpropCpu, jbs::BpropImpl, jbs::BindDsd<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmUpdatCpu, jbs::UpdatImpl, jbs::BindSdd<ffi::ThreadPool>());
