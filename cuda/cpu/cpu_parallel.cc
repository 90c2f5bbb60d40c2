// Work items on XLA's intra-op thread pool (see cpu_parallel.h).
#include "cpu/cpu_parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#if defined(__linux__)
#include <sys/mman.h>  // madvise
#endif

namespace ffi = xla::ffi;

namespace jbs {
namespace cpu {
namespace {

// Work shared by the caller and the pool tasks. Tasks that start after every item is
// claimed touch only this state (kept alive by their shared_ptr), never the job.
struct Work {
  int64_t count;
  int64_t grain;  // items claimed at once
  void (*body)(void*, int64_t);
  void* arg;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Run() {
    int64_t finished = 0;
    for (int64_t i = next.fetch_add(grain); i < count; i = next.fetch_add(grain)) {
      const int64_t end = std::min(i + grain, count);
      for (int64_t j = i; j < end; ++j) body(arg, j);
      finished += end - i;
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
  // Many items per claim where there are thousands: one claim per item, an atomic that
  // every thread contends for, cost as much as the transpose of the 8 x 8 block it handed
  // out (bprop at block 8, 16 rows of a 1024^2 weight: 3.0 ms, now 1.2). About 64 claims
  // per thread keep the balance at the end.
  work->grain = std::max<int64_t>(1, count / (64 * (helpers + 1)));
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

}  // namespace

Parallel Workers(ffi::ThreadPool& pool, int64_t macs) {
  if (macs < kSerialMacs) return Parallel{nullptr, 1, &ForEachHere, macs};
  return Parallel{&pool, static_cast<int>(std::max<int64_t>(1, pool.num_threads())), &ForEachOnPool, macs};
}

Parallel OnTiles(const Parallel& par) {
  if (par.macs / kTileMacsPerFmaMac < kSerialMacs) return Parallel{nullptr, 1, &ForEachHere, par.macs};
  return par;
}

void AdviseHugePages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (bytes > 0 && end >= begin + 2 * kHuge) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace cpu
}  // namespace jbs
