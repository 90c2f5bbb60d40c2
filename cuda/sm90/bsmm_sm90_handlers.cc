// XLA FFI handlers of the Hopper targets jbs_bsmm_{fprop,bprop,updat}_sm90.
//
// Versions (jax_blocksparse/targets.py): fprop and bprop v2 take, after `order`, the
// layout's flat work list (work [2 * cap], work_ptr [outputs + 1]) and a string attribute
// `variant` naming the kernel design (bsmm_sm90_variants.h); v1 (no work list, the
// baseline kernels) stays registered for the programs exported before v2.
//
// Same operands and checks as jbs_bsmm_{fprop,bprop,updat} (bsmm_checks.h); updat_sm90
// has one more result: a uint8 workspace for the float32 partial sums of a split N
// reduction, sized by the lowering with this same SddWorkspaceBytes for kPlanSms SMs
// (bsmm_sm90_plan.h, through the Python binding); a larger device plans for fewer SMs
// so that the workspace always suffices. A result rather than the FFI
// scratch allocator, so that a CUDA graph replays with a buffer XLA owns.
//
// The targets require a device of compute capability 9.x (the kernels are sm_90a
// SASS only) and return an FFI error elsewhere. Problems the sm_90a kernels do not
// cover (exact float32; zero-sized dimensions) run the Ampere
// kernels, which Hopper runs too.
//
// Every sm90 target takes one attribute, `tf32` (bool): float32 inputs run on TF32
// tensor cores (ops/_lowering.py sets it for float32 at DEFAULT/HIGH precision, as
// jnp.dot on GPU, at the block sizes of bsmm_sm90_tf32.h; HIGHEST gives false: the exact
// float32 kernels). tf32=true at a block size where TF32 is off (fprop and bprop at block
// 8) is an InvalidArgument error, never a launch: the lowering does not ask for it. TF32 GMMA
// reads both operands K-major only, so with tf32 some operands come transposed:
//   fprop: w holds the blocks transposed (w[s]^T), x as usual;
//   bprop: as usual (w[s] viewed [n, k] is already K-major);
//   updat: x^T [C, n] and dy^T [K, n] (rank 2, n padded with zero rows to a multiple
//          of 4), instead of x [N..., C] and dy [N..., K].
//
// Stages, as for the Ampere targets (bsmm_cuda_handlers.cc), with the same per-device
// preparation (bsmm_cuda_device.h): initialize (never captured) reads the device's compute
// capability and SM count and prepares both kernel families once per device; execute
// makes only capture-safe calls.
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>

#include "bsmm_checks.h"
#include "bsmm_cuda_device.h"
#include "bsmm_kernels.h"
#include "sm90/bsmm_sm90.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbs {
namespace sm90 {
namespace {

ffi::Error NotHopper(const char* op, int device, const CudaDeviceFacts& info) {
  if (info.major == 9) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": needs a compute capability 9.x (Hopper) GPU, but device " +
                                     std::to_string(device) + " has compute capability " + std::to_string(info.major) +
                                     "." + std::to_string(info.minor) +
                                     "; lower without JAX_BLOCKSPARSE_HOPPER=1 to use the portable kernels");
}

// Both kernel families on one device: the sm_90a ones and the Ampere-design ones, which
// run the problems the sm_90a kernels do not cover.
cudaError_t PrepareBothFamilies() {
  cudaError_t err = PrepareKernelsSm90();
  return err == cudaSuccess ? jbs::PrepareKernels() : err;
}

// The devices prepared for the Hopper targets (bsmm_cuda_device.h): compute 9.x only.
PreparedDevices& Devices() {
  static PreparedDevices devices(&PrepareBothFamilies, &NotHopper);
  return devices;
}

using DeviceInfo = CudaDeviceFacts;

ffi::Error RequireDevice(const char* op, cudaStream_t stream, DeviceInfo* info) {
  return Devices().Require(op, stream, info);
}

// A rank-2 buffer [r, c] seen as [c, r] (same data): lets the shared checks read the
// transposed operands of a tf32 updat as the [n, C] / [n, K] products they describe.
class TransposedView {
 public:
  explicit TransposedView(const ffi::AnyBuffer& b) {
    dims_[0] = b.dimensions()[1];
    dims_[1] = b.dimensions()[0];
    buf_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    buf_.extension_start = nullptr;
    buf_.dtype = static_cast<XLA_FFI_DataType>(b.element_type());
    buf_.data = b.untyped_data();
    buf_.rank = 2;
    buf_.dims = dims_;
  }
  TransposedView(const TransposedView&) = delete;  // buf_ points into this object
  TransposedView& operator=(const TransposedView&) = delete;
  ffi::AnyBuffer buffer() const { return ffi::AnyBuffer(&buf_); }

 private:
  int64_t dims_[2];
  XLA_FFI_Buffer buf_;
};

ffi::Error DsdImpl(const char* op, bool transpose, cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer w,
                   ffi::AnyBuffer block_rows, ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                   ffi::AnyBuffer row_slots, ffi::AnyBuffer order, const ffi::AnyBuffer* work,
                   const ffi::AnyBuffer* work_ptr, ffi::Result<ffi::AnyBuffer> out, bool tf32,
                   std::string_view variant_name) {
  KernelDtypes dt;
  DsdParams p;
  if (ffi::Error e =
          CheckDsd(op, transpose, a, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order, *out, &dt, &p);
      e.failure()) {
    return e;
  }
  if (work != nullptr) {
    if (ffi::Error e = CheckWorkList(op, *work, *work_ptr, &p); e.failure()) return e;
  }
  DsdVariant variant;
  if (!ParseDsdVariant(variant_name.data(), variant_name.size(), &variant)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": unknown variant '" + std::string(variant_name) +
                                       "' (cuda/sm90/bsmm_sm90_variants.h names them)");
  }
  if (!DsdVariantRuns(variant, dt.in, tf32, p.bs)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": variant '" + std::string(variant_name) + "' does not run " +
                                       (tf32 ? "tf32" : DtypeName(a.element_type())) + " at block size " +
                                       std::to_string(p.bs) +
                                       " (the lowering does not ask for "
                                       "it: cuda/sm90/bsmm_sm90_variants.h), got " +
                                       DescribeDsd(a, w, *out).str());
  }
  // With tf32, fprop's w holds transposed blocks: only the TF32 kernel reads them right.
  if (tf32 && dt.in != DType::kF32) {
    return ffi::Error::InvalidArgument(std::string(op) + ": tf32=true needs float32 inputs, got " +
                                       DescribeDsd(a, w, *out).str());
  }
  if (tf32 && !DsdTF32Block(p.bs)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": tf32=true at block size " + std::to_string(p.bs) +
                                       ", where the TF32 kernel is off (cuda/sm90/bsmm_sm90_tf32.h; the lowering "
                                       "passes tf32=false there), got " +
                                       DescribeDsd(a, w, *out).str());
  }
  DeviceInfo info;
  if (ffi::Error e = RequireDevice(op, stream, &info); e.failure()) return e;
  if (IsEmpty(p)) return ffi::Error::Success();
  cudaError_t err;
  if (tf32 && Sm90RunsDsdTF32(dt.in, p)) {
    Launch launch;
    launch.stream = stream;
    launch.num_sms = info.num_sms;
    err = LaunchDsdTF32(p, launch);
  } else if (Sm90RunsDsd(dt.in, p)) {
    Launch launch;
    launch.stream = stream;
    launch.num_sms = info.num_sms;
    err = LaunchDsd(dt.in, dt.out_f32, transpose, p, launch, variant);
  } else {
    // Also a tf32 problem with no input block or no slot: its output is all zeros, so
    // the orientation of w's blocks does not matter.
    err = jbs::LaunchDsd(dt.in, dt.out_f32, transpose, p, jbs::Launch{stream});
  }
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return LaunchError(op, err, DescribeDsd(a, w, *out));
  return ffi::Error::Success();
}

// v1: the five tables and the order; the baseline kernels.
ffi::Error FpropImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> y, bool tf32) {
  return DsdImpl("jbs_bsmm_fprop_sm90", false, stream, x, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order,
                 nullptr, nullptr, y, tf32, "baseline");
}

ffi::Error BpropImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> dx, bool tf32) {
  return DsdImpl("jbs_bsmm_bprop_sm90", true, stream, g, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order,
                 nullptr, nullptr, dx, tf32, "baseline");
}

// v2: + the layout's work list (col_work / row_work and its pointers) and the `variant` attribute.
ffi::Error FpropV2Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                       ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                       ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::AnyBuffer work, ffi::AnyBuffer work_ptr,
                       ffi::Result<ffi::AnyBuffer> y, bool tf32, std::string_view variant) {
  return DsdImpl("jbs_bsmm_fprop_sm90", false, stream, x, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order,
                 &work, &work_ptr, y, tf32, variant);
}

ffi::Error BpropV2Impl(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                       ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                       ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::AnyBuffer work, ffi::AnyBuffer work_ptr,
                       ffi::Result<ffi::AnyBuffer> dx, bool tf32, std::string_view variant) {
  return DsdImpl("jbs_bsmm_bprop_sm90", true, stream, g, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order,
                 &work, &work_ptr, dx, tf32, variant);
}

// The operands of the v2 DSD targets: those of BindDsd (bsmm_checks.h) with the work list
// after `order`, then the attributes.
auto BindDsdV2() {
  using ffi::AnyBuffer;
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<AnyBuffer>()  // lhs: x [N..., C] (fprop) or g [N..., K] (bprop)
      .Arg<AnyBuffer>()  // w [cap, bs, bs]
      .Arg<AnyBuffer>()  // block_rows [cap]
      .Arg<AnyBuffer>()  // block_cols [cap]
      .Arg<AnyBuffer>()  // col_ptr [KB + 1]
      .Arg<AnyBuffer>()  // row_ptr [CB + 1]
      .Arg<AnyBuffer>()  // row_slots [cap]
      .Arg<AnyBuffer>()  // order [KB] (fprop) or [CB] (bprop), longest first
      .Arg<AnyBuffer>()  // work [2 * cap]: col_work (fprop) or row_work (bprop)
      .Arg<AnyBuffer>()  // work_ptr: col_work_ptr [KB + 1] (fprop) or row_work_ptr [CB + 1] (bprop)
      .Ret<AnyBuffer>()  // y [N..., K] (fprop) or dx [N..., C] (bprop)
      .Attr<bool>("tf32")
      .Attr<std::string_view>("variant");
}

ffi::Error UpdatImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> workspace,
                     bool tf32) {
  const char* op = "jbs_bsmm_updat_sm90";
  KernelDtypes dt;
  SddParams p;
  if (tf32) {
    if (x.dimensions().size() != 2 || dy.dimensions().size() != 2) {
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": tf32=true takes x^T [C, n] and dy^T [K, n] (rank 2), got " +
                                         DescribeSdd(x, dy, *dw).str());
    }
    // The checks (and the problem they fill) see the [n, C] / [n, K] products; the data
    // pointers stay those of x^T and dy^T, which the TF32 kernel reads K-major.
    TransposedView xv(x), dyv(dy);
    if (ffi::Error e =
            CheckSdd(op, xv.buffer(), dyv.buffer(), block_rows, block_cols, col_ptr, row_ptr, row_slots, *dw, &dt, &p);
        e.failure()) {
      return e;
    }
    if (dt.in != DType::kF32 || p.n % kSddTF32RowMultiple != 0) {
      return ffi::Error::InvalidArgument(std::string(op) + ": tf32=true needs float32 inputs and n a multiple of " +
                                         std::to_string(kSddTF32RowMultiple) + ", got " +
                                         DescribeSdd(x, dy, *dw).str() + " (x^T, dy^T)");
    }
    if (!SddTF32Block(p.bs)) {
      return ffi::Error::InvalidArgument(std::string(op) + ": tf32=true at block size " + std::to_string(p.bs) +
                                         ", where the TF32 kernel is off (cuda/sm90/bsmm_sm90_tf32.h), got " +
                                         DescribeSdd(x, dy, *dw).str() + " (x^T, dy^T)");
    }
  } else if (ffi::Error e = CheckSdd(op, x, dy, block_rows, block_cols, col_ptr, row_ptr, row_slots, *dw, &dt, &p);
             e.failure()) {
    return e;
  }
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the workspace result must be uint8 of rank 1, got " +
                                       ShapeStr(*workspace));
  }
  DeviceInfo info;
  if (ffi::Error e = RequireDevice(op, stream, &info); e.failure()) return e;
  if (IsEmpty(p)) return ffi::Error::Success();
  cudaError_t err;
  if (tf32 ? Sm90RunsSddTF32(dt.in, p) : Sm90RunsSdd(dt.in, p)) {
    Launch launch;
    launch.stream = stream;
    launch.num_sms = info.num_sms;
    // Plan for no more SMs than the workspace was sized for: the lowering's workspace says
    // which updat variant runs (bsmm_sm90_variants.h: the capped one gets a smaller one).
    const size_t have = workspace->size_bytes();
    const int plan_sms = SddPlanSmsWithin(dt.in, p, have, tf32, info.num_sms);
    if (SddWorkspaceBytes(dt.in, p, plan_sms, tf32) > have) {
      return ffi::Error::InvalidArgument(std::string(op) + ": workspace of " + std::to_string(have) +
                                         " bytes is too small (needs " +
                                         std::to_string(SddWorkspaceBytes(dt.in, p, plan_sms, tf32)) + ")");
    }
    launch.plan_sms = plan_sms;
    launch.workspace = workspace->untyped_data();
    err = tf32 ? LaunchSddTF32(p, launch) : LaunchSdd(dt.in, dt.out_f32, p, launch);
  } else {
    // Also a tf32 problem with no input or output block column (n > 0, multiple of 4):
    // every slot is out of range, so dw is all zeros whatever the operands' orientation.
    err = jbs::LaunchSdd(dt.in, dt.out_f32, p, jbs::Launch{stream});
  }
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return LaunchError(op, err, DescribeSdd(x, dy, *dw));
  return ffi::Error::Success();
}

ffi::Error InitializeImpl(cudaStream_t stream) {
  return Devices().PrepareStreamDevice("jbs_bsmm_sm90 (initialize)", stream);
}

}  // namespace
}  // namespace sm90
}  // namespace jbs

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JbsBsmmInitializeSm90, jbs::sm90::InitializeImpl,
    ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>().Ctx<ffi::PlatformStream<cudaStream_t>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmFpropSm90, jbs::sm90::FpropImpl,
                              jbs::BindDsd<ffi::PlatformStream<cudaStream_t>>().Attr<bool>("tf32"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmBpropSm90, jbs::sm90::BpropImpl,
                              jbs::BindDsd<ffi::PlatformStream<cudaStream_t>>().Attr<bool>("tf32"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmFpropSm90V2, jbs::sm90::FpropV2Impl, jbs::sm90::BindDsdV2(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmBpropSm90V2, jbs::sm90::BpropV2Impl, jbs::sm90::BindDsdV2(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmUpdatSm90, jbs::sm90::UpdatImpl,
                              jbs::BindSdd<ffi::PlatformStream<cudaStream_t>>()
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<bool>("tf32"),
                              {ffi::Traits::kCmdBufferCompatible});
