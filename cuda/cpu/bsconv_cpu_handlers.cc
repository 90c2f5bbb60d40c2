// XLA FFI handlers of the block-sparse convolution on CPU (implicit GEMM, see bsconv_cpu.h):
// the checks, then the kernels on XLA's intra-op thread pool (cpu_parallel.h).
//
// Targets (operands in order; tables as for bsmm, bsmm_checks.h):
//
//   jbs_bsconv(a [N, *in, Cin], w [cap, *kernel, bs, bs], block_rows, block_cols, col_ptr,
//              row_ptr, row_slots, order) -> out [N, *out, Cout]
//       order: the layout's col_order (plain: Cin = C, Cout = K) or row_order
//       (transpose_kernel: Cin = K, Cout = C), the output blocks longest first.
//   jbs_bsconv_wgrad(a [N, *in, Ca], b [N, *out, Cb], <the five tables>) -> dw [cap, *kernel, bs, bs]
//       plain: Ca = C, Cb = K; transpose_kernel: Ca = K, Cb = C.
//
// Attributes of both: window_strides, lhs_dilation, rhs_dilation, padding_low (int64
// arrays, one entry per spatial dim) and transpose_kernel (bool). 1 to 3 spatial dims.
// The output spatial shape is the result buffer's: the kernels compute every output
// position it has (those past the input read zeros). Inputs float32, bfloat16 or
// float16, both alike; the output is that dtype or float32. Any mismatch returns
// InvalidArgument naming the target and the shapes; the table values are never trusted
// (indices out of range are skipped).
#include <algorithm>
#include <cstdint>
#include <string>

#include "bsmm_checks.h"
#include "cpu/bsconv_cpu.h"
#include "cpu/cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbs {
namespace {

using Dims = ffi::Span<const int64_t>;

// Bounds that keep every index of the kernels' arithmetic far from int64 overflow.
constexpr int64_t kMaxFactor = int64_t{1} << 20;  // strides, dilations
constexpr int64_t kMaxExtent = int64_t{1} << 31;  // spatial dims, |padding|

std::string Join(Dims d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + ")";
}

std::string Shapes(const char* a_name, const ffi::AnyBuffer& a, const char* b_name, const ffi::AnyBuffer& b,
                   const char* out_name, const ffi::AnyBuffer& out) {
  return std::string(a_name) + " " + ShapeStr(a) + ", " + b_name + " " + ShapeStr(b) + ", " + out_name + " " +
         ShapeStr(out);
}

// Fills g from the attributes and the shapes of the input `a` [N, *in, Ca], the output
// `y` [N, *out, Cy] and the blocks `w` [cap, *kernel, bs, bs].
ffi::Error CheckGeometry(const char* op, const ffi::AnyBuffer& a, const ffi::AnyBuffer& y, const ffi::AnyBuffer& w,
                         Dims strides, Dims lhs_dilation, Dims rhs_dilation, Dims padding_low,
                         const std::string& shapes, cpu::ConvGeometry* g) {
  const int64_t nd = static_cast<int64_t>(w.dimensions().size()) - 3;
  if (nd < 1 || nd > cpu::kMaxConvDims) {
    return Invalid(op, "the blocks must be [capacity, *kernel_size, bs, bs] with 1 to 3 spatial dims; got " + shapes);
  }
  auto ad = a.dimensions();
  auto yd = y.dimensions();
  if (static_cast<int64_t>(ad.size()) != nd + 2 || static_cast<int64_t>(yd.size()) != nd + 2 || ad[0] != yd[0]) {
    return Invalid(op, "need input [N, *spatial, C] and output [N, *spatial, K] with " + std::to_string(nd) +
                           " spatial dims and one N; got " + shapes);
  }
  const Dims* attrs[] = {&strides, &lhs_dilation, &rhs_dilation, &padding_low};
  const char* names[] = {"window_strides", "lhs_dilation", "rhs_dilation", "padding_low"};
  for (int i = 0; i < 4; ++i) {
    if (static_cast<int64_t>(attrs[i]->size()) != nd) {
      return Invalid(op, std::string(names[i]) + " must have one entry per spatial dim (" + std::to_string(nd) +
                             "), got " + Join(*attrs[i]));
    }
    for (int64_t v : *attrs[i]) {
      const bool ok = i == 3 ? (v > -kMaxExtent && v < kMaxExtent) : (v >= 1 && v <= kMaxFactor);
      if (!ok) {
        return Invalid(op, std::string(names[i]) + " out of range: " + Join(*attrs[i]) +
                               (i == 3 ? "" : " (each must be in [1, 2^20])"));
      }
    }
  }
  auto wd = w.dimensions();
  g->ndim = static_cast<int>(nd);
  for (int64_t d = 0; d < nd; ++d) {
    if (ad[d + 1] >= kMaxExtent || yd[d + 1] >= kMaxExtent || wd[d + 1] < 1 || wd[d + 1] >= kMaxExtent) {
      return Invalid(op, "spatial dims must be < 2^31 and kernel dims >= 1; got " + shapes);
    }
    g->in[d] = ad[d + 1];
    g->out[d] = yd[d + 1];
    g->kernel[d] = wd[d + 1];
    g->stride[d] = strides[d];
    g->lhs_dilation[d] = lhs_dilation[d];
    g->rhs_dilation[d] = rhs_dilation[d];
    g->pad_lo[d] = padding_low[d];
  }
  return ffi::Error::Success();
}

// The blocks are [cap, *kernel, bs, bs] with a supported bs.
ffi::Error CheckBlocks(const char* op, const char* name, const ffi::AnyBuffer& w, int64_t cap,
                       const std::string& shapes, int64_t* bs) {
  auto wd = w.dimensions();
  const size_t r = wd.size();
  if (r < 4 || wd[0] != cap || wd[r - 1] != wd[r - 2] || !SupportedBlockSize(wd[r - 1])) {
    return Invalid(op, std::string(name) + " must be [capacity=" + std::to_string(cap) +
                           ", *kernel_size, bs, bs] with bs in " + kBlockSizesText + "; got " + shapes);
  }
  *bs = wd[r - 1];
  return ffi::Error::Success();
}

ffi::Error Unsupported(const char* op, const std::string& shapes) {
  return ffi::Error::Internal(std::string(op) +
                              ": no CPU kernel for this block size, or no memory for its "
                              "scratch buffers; " +
                              shapes);
}

int64_t Taps(const cpu::ConvGeometry& g) {
  int64_t t = 1;
  for (int d = 0; d < g.ndim; ++d) t *= g.kernel[d];
  return t;
}

// Multiply-adds of a checked problem at most (every tap of every stored block at every
// output position), for the serial / parallel choice.
int64_t Macs(int64_t n, const cpu::ConvGeometry& g, const int32_t* nnz, int64_t cap, int64_t bs) {
  const int64_t blocks = std::min<int64_t>(std::max<int32_t>(*nnz, 0), cap);
  int64_t positions = n;
  for (int d = 0; d < g.ndim; ++d) positions *= g.out[d];
  const double macs = static_cast<double>(positions) * blocks * Taps(g) * bs * bs;
  return macs > 1e18 ? int64_t{1} << 60 : static_cast<int64_t>(macs);
}

ffi::Error ConvImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                    ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr, ffi::AnyBuffer row_slots,
                    ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> out, Dims strides, Dims lhs_dilation,
                    Dims rhs_dilation, Dims padding_low, bool transpose_kernel) {
  const char* op = "jbs_bsconv";
  const std::string shapes = Shapes("a", a, "w", w, "out", *out);
  Tables t;
  if (ffi::Error e = CheckTables(op, block_rows, block_cols, col_ptr, row_ptr, row_slots, &t); e.failure()) return e;
  KernelDtypes dt;
  if (ffi::Error e = CheckDtypes(op, a, w, *out, &dt); e.failure()) return e;
  int64_t bs;
  if (ffi::Error e = CheckBlocks(op, "w", w, t.cap, shapes, &bs); e.failure()) return e;
  cpu::ConvParams p{};
  if (ffi::Error e = CheckGeometry(op, a, *out, w, strides, lhs_dilation, rhs_dilation, padding_low, shapes, &p.g);
      e.failure()) {
    return e;
  }
  const int64_t nin = transpose_kernel ? t.kb : t.cb;
  const int64_t nseg = transpose_kernel ? t.cb : t.kb;
  const int64_t fin = a.dimensions().back(), fout = out->dimensions().back();
  if (fin != nin * bs || fout != nseg * bs) {
    return Invalid(op, "need a [..., " + std::to_string(nin * bs) + "] and out [..., " + std::to_string(nseg * bs) +
                           "] for " + GridStr(t, bs) + (transpose_kernel ? " (transpose_kernel)" : "") + "; got " +
                           shapes);
  }
  if (order.element_type() != ffi::DataType::S32 || order.dimensions().size() != 1 || order.dimensions()[0] != nseg) {
    return Invalid(op, "order must be int32 [" + std::to_string(nseg) + "], got " + DtypeName(order.element_type()) +
                           " " + ShapeStr(order));
  }
  p.a = a.untyped_data();
  p.w = w.untyped_data();
  p.out = out->untyped_data();
  p.seg_ptr = transpose_kernel ? t.row_ptr : t.col_ptr;
  p.seg_slots = transpose_kernel ? t.row_slots : nullptr;
  p.in_block = transpose_kernel ? t.block_cols : t.block_rows;
  p.order = static_cast<const int32_t*>(order.untyped_data());
  p.nnz = t.col_ptr + t.kb;  // col_ptr[KB] == nnz
  p.n = a.dimensions()[0];
  p.nin = static_cast<int>(nin);
  p.nseg = static_cast<int>(nseg);
  p.cap = static_cast<int>(t.cap);
  p.bs = static_cast<int>(bs);
  p.transpose_kernel = transpose_kernel;
  if (out->element_count() == 0) return ffi::Error::Success();
  if (const char* isa_error = cpu::IsaOverrideError()) return ffi::Error::InvalidArgument(isa_error);
  cpu::AdviseHugePages(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  if (!cpu::RunConv(dt.in, dt.out_f32, p, cpu::Workers(pool, Macs(p.n, p.g, p.nnz, t.cap, bs)))) {
    return Unsupported(op, shapes);
  }
  return ffi::Error::Success();
}

ffi::Error WgradImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::Result<ffi::AnyBuffer> dw, Dims strides, Dims lhs_dilation,
                     Dims rhs_dilation, Dims padding_low, bool transpose_kernel) {
  const char* op = "jbs_bsconv_wgrad";
  const std::string shapes = Shapes("a", a, "b", b, "dw", *dw);
  Tables t;
  if (ffi::Error e = CheckTables(op, block_rows, block_cols, col_ptr, row_ptr, row_slots, &t); e.failure()) return e;
  KernelDtypes dt;
  if (ffi::Error e = CheckDtypes(op, a, b, *dw, &dt); e.failure()) return e;
  int64_t bs;
  if (ffi::Error e = CheckBlocks(op, "dw", *dw, t.cap, shapes, &bs); e.failure()) return e;
  cpu::ConvWgradParams p{};
  if (ffi::Error e = CheckGeometry(op, a, b, *dw, strides, lhs_dilation, rhs_dilation, padding_low, shapes, &p.g);
      e.failure()) {
    return e;
  }
  const int64_t a_blocks = transpose_kernel ? t.kb : t.cb;
  const int64_t b_blocks = transpose_kernel ? t.cb : t.kb;
  if (a.dimensions().back() != a_blocks * bs || b.dimensions().back() != b_blocks * bs) {
    return Invalid(op, "need a [..., " + std::to_string(a_blocks * bs) + "] and b [..., " +
                           std::to_string(b_blocks * bs) + "] for " + GridStr(t, bs) +
                           (transpose_kernel ? " (transpose_kernel)" : "") + "; got " + shapes);
  }
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.dw = dw->untyped_data();
  p.block_rows = t.block_rows;
  p.block_cols = t.block_cols;
  p.nnz = t.col_ptr + t.kb;
  p.n = a.dimensions()[0];
  p.a_blocks = static_cast<int>(a_blocks);
  p.b_blocks = static_cast<int>(b_blocks);
  p.cap = static_cast<int>(t.cap);
  p.bs = static_cast<int>(bs);
  p.transpose_kernel = transpose_kernel;
  if (t.cap == 0) return ffi::Error::Success();
  if (const char* isa_error = cpu::IsaOverrideError()) return ffi::Error::InvalidArgument(isa_error);
  cpu::AdviseHugePages(dw->untyped_data(), static_cast<int64_t>(dw->size_bytes()));
  if (!cpu::RunConvWgrad(dt.in, dt.out_f32, p, cpu::Workers(pool, Macs(p.n, p.g, p.nnz, t.cap, bs)))) {
    return Unsupported(op, shapes);
  }
  return ffi::Error::Success();
}

// The operands of both targets after XLA's thread pool, then the geometry attributes.
auto BindConv() {
  using ffi::AnyBuffer;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<AnyBuffer>()  // a [N, *in, Cin]
      .Arg<AnyBuffer>()  // w [cap, *kernel, bs, bs]
      .Arg<AnyBuffer>()  // block_rows [cap]
      .Arg<AnyBuffer>()  // block_cols [cap]
      .Arg<AnyBuffer>()  // col_ptr [KB + 1]
      .Arg<AnyBuffer>()  // row_ptr [CB + 1]
      .Arg<AnyBuffer>()  // row_slots [cap]
      .Arg<AnyBuffer>()  // order [Cout / bs], longest first
      .Ret<AnyBuffer>()  // out [N, *out, Cout]
      .Attr<Dims>("window_strides")
      .Attr<Dims>("lhs_dilation")
      .Attr<Dims>("rhs_dilation")
      .Attr<Dims>("padding_low")
      .Attr<bool>("transpose_kernel");
}

auto BindWgrad() {
  using ffi::AnyBuffer;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<AnyBuffer>()  // a [N, *in, Ca]
      .Arg<AnyBuffer>()  // b [N, *out, Cb]
      .Arg<AnyBuffer>()  // block_rows [cap]
      .Arg<AnyBuffer>()  // block_cols [cap]
      .Arg<AnyBuffer>()  // col_ptr [KB + 1]
      .Arg<AnyBuffer>()  // row_ptr [CB + 1] (unused)
      .Arg<AnyBuffer>()  // row_slots [cap] (unused)
      .Ret<AnyBuffer>()  // dw [cap, *kernel, bs, bs]
      .Attr<Dims>("window_strides")
      .Attr<Dims>("lhs_dilation")
      .Attr<Dims>("rhs_dilation")
      .Attr<Dims>("padding_low")
      .Attr<bool>("transpose_kernel");
}

}  // namespace
}  // namespace jbs

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsconvCpu, jbs::ConvImpl, jbs::BindConv());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsconvWgradCpu, jbs::WgradImpl, jbs::BindWgrad());
