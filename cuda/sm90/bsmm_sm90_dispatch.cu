// sm_90a launchers: dtype dispatch, the updat workspace size, per-device preparation.
// No CuTe here (the kernels live in the per-dtype translation units).
#include <initializer_list>

#include "bsmm_work_plan.h"
#include "sm90/bsmm_sm90.h"

namespace jbs {
namespace sm90 {

namespace {
bool Is16Bit(DType in) { return in == DType::kF16 || in == DType::kBF16; }
}  // namespace

bool Sm90RunsDsd(DType in, const DsdParams& p) {
  const bool block = p.bs == 8 || p.bs == 16 || p.bs == 32 || p.bs == 64 || p.bs == 128;
  return Is16Bit(in) && block && p.n > 0 && p.nin > 0 && p.nseg > 0 && p.cap > 0;
}

bool Sm90RunsDsdTF32(DType in, const DsdParams& p) {
  // Not every block size: bsmm_sm90_tf32.h says where TF32 is off, and why.
  return in == DType::kF32 && DsdTF32Block(p.bs) && p.n > 0 && p.nin > 0 && p.nseg > 0 && p.cap > 0;
}

bool Sm90RunsSdd(DType in, const SddParams& p) {
  const bool block = p.bs == 8 || p.bs == 16 || p.bs == 32 || p.bs == 64 || p.bs == 128;
  return Is16Bit(in) && block && p.n > 0 && p.cb > 0 && p.kb > 0 && p.cap > 0;
}

bool Sm90RunsSddTF32(DType in, const SddParams& p) {
  // n % 4: the rows of x^T / dy^T are TMA tensors, whose strides are multiples of 16 bytes.
  return in == DType::kF32 && SddTF32Block(p.bs) && p.n > 0 && p.n % 4 == 0 && p.cb > 0 && p.kb > 0 &&
         p.cap > 0;
}

cudaError_t LaunchDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Launch& launch) {
  if (!launch.prepare_only && !Sm90RunsDsd(in, p)) return cudaErrorInvalidValue;
  if (p.bs < 64) {
    return in == DType::kF16 ? LaunchDsdSmallF16(out_f32, transpose_w, p, launch)
                             : LaunchDsdSmallBF16(out_f32, transpose_w, p, launch);
  }
  return in == DType::kF16 ? LaunchDsdF16(out_f32, transpose_w, p, launch)
                           : LaunchDsdBF16(out_f32, transpose_w, p, launch);
}

size_t SddWorkspaceBytes(DType in, const SddParams& p, int num_sms, bool tf32) {
  if (!(tf32 ? Sm90RunsSddTF32(in, p) : Sm90RunsSdd(in, p))) return 0;
  // The TF32 kernel has the same slot groups and k-step (SddGroupFor, SddTileKFor): same plan.
  const plan::SddPlan pl =
      plan::MakeSddPlan(p.cap, SddGroupFor(p.bs), p.n, SddTileKFor(p.bs), num_sms > 0 ? num_sms : 1);
  return static_cast<size_t>(plan::SddWorkspaceElems(pl, p.bs)) * sizeof(float);
}

cudaError_t LaunchSdd(DType in, bool out_f32, const SddParams& p, const Launch& launch) {
  if (!launch.prepare_only && !Sm90RunsSdd(in, p)) return cudaErrorInvalidValue;
  if (p.bs < 64) {
    return in == DType::kF16 ? LaunchSddSmallF16(out_f32, p, launch) : LaunchSddSmallBF16(out_f32, p, launch);
  }
  return in == DType::kF16 ? LaunchSddF16(out_f32, p, launch) : LaunchSddBF16(out_f32, p, launch);
}

cudaError_t PrepareKernelsSm90() {
  Launch prepare;
  prepare.prepare_only = true;
  for (int bs : {8, 16, 32, 64, 128}) {
    DsdParams dsd{};
    dsd.bs = bs;
    SddParams sdd{};
    sdd.bs = bs;
    // float32 on TF32 tensor cores, where it is on (bsmm_sm90_tf32.h)
    if (DsdTF32Block(bs)) {
      if (cudaError_t err = LaunchDsdTF32(dsd, prepare); err != cudaSuccess) return err;
    }
    if (SddTF32Block(bs)) {
      if (cudaError_t err = LaunchSddTF32(sdd, prepare); err != cudaSuccess) return err;
    }
    for (DType in : {DType::kF16, DType::kBF16}) {
      for (bool out_f32 : {false, true}) {
        for (bool transpose_w : {false, true}) {
          if (cudaError_t err = LaunchDsd(in, out_f32, transpose_w, dsd, prepare); err != cudaSuccess) return err;
        }
        if (cudaError_t err = LaunchSdd(in, out_f32, sdd, prepare); err != cudaSuccess) return err;
      }
    }
  }
  return cudaSuccess;
}

}  // namespace sm90
}  // namespace jbs
