// The dense path's conversions on CPU: the blocks of w [capacity, bs, bs] placed into the
// dense W [C, K] (zero elsewhere), or into its transpose W^T [K, C] (version 2, attribute
// `transpose`), and back: the layout's blocks of a dense dW [C, K] gathered into
// [capacity, bs, bs] (zero at padding slots). And updat's x^T, a plain transpose
// (jbs_transpose, at the end).
//
// W^T is for bprop's dense path, g @ W^T, in bfloat16 on a CPU with bfloat16 dot
// instructions: XLA runs a bfloat16 dot with float32 sums on them when both operands are
// row-major (2.2 ms at 1024 cubed on a 2-core AMX machine, 2.7 ms with AVX512-BF16), but
// g @ W.T of a row-major W as a float32 dot (8.9 ms and 5.5 ms).
//
// impl="dense" (and "auto" above the crossover) computes bsmm as XLA's dot on W; its cost
// beside the dot a user would write, x @ W, is this conversion. XLA's own scatter and gather
// of [bs, bs] slices took about 1.2-1.8 ms for a 1024 x 1024 weight on a 2-core machine
// (10-50% of the dot there); a row copy per block, one pass over W on XLA's thread pool,
// is a memory copy. The operands are the bsmm targets' five tables (bsmm_checks.h), whose
// values are checked here: every present slot (s < col_ptr[K/bs]) must name a block
// inside the grid; a cell named twice keeps the later slot's block.
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "bsmm_block_sizes.h"
#include "bsmm_checks.h"
#include "cpu/bsmm_cpu.h"
#include "cpu/cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbs {
namespace {

struct Placement {
  int64_t cb = 0, kb = 0, bs = 0, cap = 0, nnz = 0;
  size_t item = 0;            // bytes per element
  std::vector<int32_t> slot;  // [cb * kb]: the slot of each grid cell, -1 for none
};

// The tables checked and turned into a grid of slots. `blocks` is w (or dw), [cap, bs, bs];
// `dense` is W (or dW), [C, K] of the same dtype.
// `transposed`: the dense matrix is W^T [K, C].
ffi::Error Place(const char* op, const ffi::AnyBuffer& blocks, const ffi::AnyBuffer& dense,
                 const ffi::AnyBuffer& block_rows, const ffi::AnyBuffer& block_cols, const ffi::AnyBuffer& col_ptr,
                 const ffi::AnyBuffer& row_ptr, const ffi::AnyBuffer& row_slots, bool transposed, Placement* p) {
  Tables t;
  if (ffi::Error e = CheckTables(op, block_rows, block_cols, col_ptr, row_ptr, row_slots, &t); e.failure()) return e;
  const ffi::DataType dtype = blocks.element_type();
  const bool supported = dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16;
  if (!supported || dtype != dense.element_type()) {
    return Invalid(op, std::string("the blocks and the dense matrix must share one dtype among float32, float16, "
                                   "bfloat16, got ") +
                           DtypeName(blocks.element_type()) + " " + ShapeStr(blocks) + " and " +
                           DtypeName(dense.element_type()) + " " + ShapeStr(dense));
  }
  auto bd = blocks.dimensions();
  auto dd = dense.dimensions();
  const int64_t rows_b = transposed ? t.kb : t.cb, cols_b = transposed ? t.cb : t.kb;
  if (bd.size() != 3 || bd[0] != t.cap || bd[1] != bd[2] || !SupportedBlockSize(bd[2]) || dd.size() != 2 ||
      dd[0] != rows_b * bd[2] || dd[1] != cols_b * bd[2]) {
    return Invalid(op, "blocks must be [capacity=" + std::to_string(t.cap) + ", bs, bs] with bs in " + kBlockSizesText +
                           " and the dense matrix" + (transposed ? " (transposed) [" : " [") + std::to_string(rows_b) +
                           " * bs, " + std::to_string(cols_b) + " * bs], got " + ShapeStr(blocks) + " and " +
                           ShapeStr(dense));
  }
  p->cb = t.cb;
  p->kb = t.kb;
  p->bs = bd[2];
  p->cap = t.cap;
  p->item = dtype == ffi::DataType::F32 ? 4 : 2;
  p->nnz = t.col_ptr[t.kb];
  if (p->nnz < 0 || p->nnz > t.cap) {
    return Invalid(op, "col_ptr[-1] (the blocks present) must be in [0, capacity=" + std::to_string(t.cap) + "], got " +
                           std::to_string(p->nnz));
  }
  p->slot.assign(static_cast<size_t>(t.cb * t.kb), -1);
  for (int64_t s = 0; s < p->nnz; ++s) {
    const int32_t r = t.block_rows[s], c = t.block_cols[s];
    if (r < 0 || r >= t.cb || c < 0 || c >= t.kb) {
      return Invalid(op, "slot " + std::to_string(s) + " names block (" + std::to_string(r) + ", " + std::to_string(c) +
                             "), outside the " + std::to_string(t.cb) + " x " + std::to_string(t.kb) + " grid");
    }
    p->slot[static_cast<size_t>(r) * t.kb + c] = static_cast<int32_t>(s);
  }
  return ffi::Error::Success();
}

// The M x M tile at `in` (row stride ldi elements) transposed into `out` (stride ldo),
// M = 16 bytes / ITEM: one 128-bit register per row. With SSE2 (every x86-64), in
// registers: unpacking pairs of rows, then pairs of pairs, which a compiler does not find
// for the scalar loop (jbs_transpose of 1024 x 1024 in 16 bits: 89 us against 153 us
// scalar, a copy 23 us; in float32 183 us against 208 us, a copy 61 us). Both W^T and x^T
// are built of these tiles.
template <int ITEM>
inline void TransposeMicro(const char* in, int64_t ldi, char* out, int64_t ldo) {
  constexpr int M = 16 / ITEM;
#if defined(__SSE2__)
  __m128i r[M];
  for (int i = 0; i < M; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * ldi * ITEM));
  if constexpr (ITEM == 2) {  // 8 x 8 of 16 bits: pairs of elements, of pairs, of quads
    __m128i a[8], b[8];
    for (int i = 0; i < 4; ++i) {
      a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
      for (int q = 0; q < 2; ++q) {
        b[4 * h + 2 * q] = _mm_unpacklo_epi32(a[4 * h + q], a[4 * h + q + 2]);
        b[4 * h + 2 * q + 1] = _mm_unpackhi_epi32(a[4 * h + q], a[4 * h + q + 2]);
      }
    }
    for (int c = 0; c < 4; ++c) {  // b[c] holds columns 2c, 2c+1 of rows 0-3, b[4 + c] of rows 4-7
      r[2 * c] = _mm_unpacklo_epi64(b[c], b[4 + c]);
      r[2 * c + 1] = _mm_unpackhi_epi64(b[c], b[4 + c]);
    }
  } else {  // 4 x 4 of 32 bits
    const __m128i a0 = _mm_unpacklo_epi32(r[0], r[1]), a1 = _mm_unpackhi_epi32(r[0], r[1]);
    const __m128i a2 = _mm_unpacklo_epi32(r[2], r[3]), a3 = _mm_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm_unpacklo_epi64(a0, a2);
    r[1] = _mm_unpackhi_epi64(a0, a2);
    r[2] = _mm_unpacklo_epi64(a1, a3);
    r[3] = _mm_unpackhi_epi64(a1, a3);
  }
  for (int j = 0; j < M; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j * ldo * ITEM), r[j]);
#else
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < M; ++j) std::memcpy(out + (j * ldo + i) * ITEM, in + (i * ldi + j) * ITEM, ITEM);
#endif
}

struct ToDenseArgs {
  const Placement* p;
  const char* w;
  char* W;
};

// One block row of W: bs rows, each K elements of copied block rows or zeros. The row
// length is a compile-time constant (BS elements of ITEM bytes), so each copy is a few
// vector moves, not a call: at block 8 there are C * K / 8 of them. Small blocks are
// copied whole, one after another (the source read in order: a block of 8 is 4 rows of a
// cache line, and row by row across the blocks it ran 25% slower than a memory copy);
// large ones row by row across the blocks (the destination written in order).
template <int BS, int ITEM>
void ToDenseRow(void* arg, int64_t r) {
  const auto* a = static_cast<const ToDenseArgs*>(arg);
  const Placement& p = *a->p;
  constexpr size_t kRow = static_cast<size_t>(BS) * ITEM;
  const int32_t* slots = p.slot.data() + r * p.kb;
  if constexpr (BS <= 16) {
    char* first = a->W + r * BS * p.kb * kRow;
    for (int64_t c = 0; c < p.kb; ++c) {
      const char* block = slots[c] < 0 ? nullptr : a->w + static_cast<int64_t>(slots[c]) * BS * kRow;
      for (int64_t i = 0; i < BS; ++i) {
        char* out = first + (i * p.kb + c) * kRow;
        if (block == nullptr) {
          std::memset(out, 0, kRow);
        } else {
          std::memcpy(out, block + i * kRow, kRow);
        }
      }
    }
    return;
  }
  for (int64_t i = 0; i < BS; ++i) {
    char* out = a->W + (r * BS + i) * p.kb * kRow;
    for (int64_t c = 0; c < p.kb; ++c, out += kRow) {
      if (slots[c] < 0) {
        std::memset(out, 0, kRow);
      } else {
        std::memcpy(out, a->w + (static_cast<int64_t>(slots[c]) * BS + i) * kRow, kRow);
      }
    }
  }
}

// One block row c of W^T [K, C]: bs rows, row i of it holding column c * bs + i of W, i.e.
// element i of every row of the blocks (r, c), or zeros. Block by block down the column
// (each read once, in order), in micro tiles (TransposeMicro); each row's pieces are
// written in order along it. A bfloat16 W^T of 1024 x 1024 takes 56-90 us so on the AMD
// EPYC (W itself 37-92 us); read a column of a block at a time, 151-349 us.
template <int BS, int ITEM>
void ToDenseTransposedRow(void* arg, int64_t c) {
  constexpr int M = 16 / ITEM;
  static_assert(BS % M == 0, "block sizes are multiples of the micro tile");
  const auto* a = static_cast<const ToDenseArgs*>(arg);
  const Placement& p = *a->p;
  const int64_t ldo = p.cb * BS;  // W^T's row length, elements
  char* band = a->W + c * BS * ldo * ITEM;
  for (int64_t r = 0; r < p.cb; ++r) {
    const int32_t slot = p.slot[r * p.kb + c];
    char* out = band + r * BS * ITEM;
    if (slot < 0) {
      for (int64_t i = 0; i < BS; ++i) std::memset(out + i * ldo * ITEM, 0, BS * ITEM);
      continue;
    }
    const char* block = a->w + static_cast<int64_t>(slot) * BS * BS * ITEM;
    for (int i0 = 0; i0 < BS; i0 += M) {
      for (int j0 = 0; j0 < BS; j0 += M) {
        TransposeMicro<ITEM>(block + (j0 * BS + i0) * ITEM, BS, out + (i0 * ldo + j0) * ITEM, ldo);
      }
    }
  }
}

struct ToBlocksArgs {
  const Placement* p;
  const std::vector<int64_t>* cell;  // [cap]: the grid cell of each slot, -1 at padding
  const char* W;
  char* w;
};

// Slots per work item of the conversion to blocks: about 16K elements, so that a small block
// (256 bytes at block 8) is not a work item of its own.
constexpr int64_t SlotsPerItem(int bs) { return 16384 / (int64_t{bs} * bs) > 1 ? 16384 / (int64_t{bs} * bs) : 1; }

// Work item `item` of w: its slots' blocks, bs rows each, copied out of W, or zeros at
// padding.
template <int BS, int ITEM>
void ToBlocksSlots(void* arg, int64_t item) {
  const auto* a = static_cast<const ToBlocksArgs*>(arg);
  const Placement& p = *a->p;
  constexpr size_t kRow = static_cast<size_t>(BS) * ITEM;
  const int64_t first = item * SlotsPerItem(BS);
  const int64_t last = first + SlotsPerItem(BS) < p.cap ? first + SlotsPerItem(BS) : p.cap;
  for (int64_t s = first; s < last; ++s) {
    char* out = a->w + s * BS * kRow;
    const int64_t cell = (*a->cell)[s];
    if (cell < 0) {
      std::memset(out, 0, BS * kRow);
      continue;
    }
    const int64_t r = cell / p.kb, c = cell % p.kb;
    for (int64_t i = 0; i < BS; ++i) {
      std::memcpy(out + i * kRow, a->W + ((r * BS + i) * p.kb + c) * kRow, kRow);
    }
  }
}

// body<BS, ITEM> for the placement's block size and element size.
template <template <int, int> class Body>
void (*Instance(const Placement& p))(void*, int64_t) {
  void (*fn)(void*, int64_t) = nullptr;
  DispatchBlockSize(p.bs, [&](auto bs) {
    fn = p.item == 4 ? Body<decltype(bs)::value, 4>::kFn : Body<decltype(bs)::value, 2>::kFn;
    return true;
  });
  return fn;
}

template <int BS, int ITEM>
struct ToDenseBody {
  static constexpr void (*kFn)(void*, int64_t) = ToDenseRow<BS, ITEM>;
};
template <int BS, int ITEM>
struct ToDenseTransposedBody {
  static constexpr void (*kFn)(void*, int64_t) = ToDenseTransposedRow<BS, ITEM>;
};
template <int BS, int ITEM>
struct ToBlocksBody {
  static constexpr void (*kFn)(void*, int64_t) = ToBlocksSlots<BS, ITEM>;
};

// Items: a call of fewer bytes than a parallel step is worth runs on the calling thread.
int64_t Weight(const Placement& p) { return p.cb * p.kb * p.bs * p.bs; }

ffi::Error ToDense(ffi::ThreadPool pool, ffi::AnyBuffer w, ffi::AnyBuffer block_rows, ffi::AnyBuffer block_cols,
                   ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr, ffi::AnyBuffer row_slots,
                   ffi::Result<ffi::AnyBuffer> dense, bool transpose) {
  Placement p;
  if (ffi::Error e =
          Place("jbs_blocks_to_dense", w, *dense, block_rows, block_cols, col_ptr, row_ptr, row_slots, transpose, &p);
      e.failure()) {
    return e;
  }
  ToDenseArgs args{&p, static_cast<const char*>(w.untyped_data()), static_cast<char*>(dense->untyped_data())};
  auto* body = transpose ? Instance<ToDenseTransposedBody>(p) : Instance<ToDenseBody>(p);
  if (body == nullptr)
    return ffi::Error::Internal("jbs_blocks_to_dense: no instance for block size " + std::to_string(p.bs));
  cpu::AdviseHugePages(dense->untyped_data(), static_cast<int64_t>(dense->size_bytes()));
  cpu::Parallel par = cpu::Workers(pool, Weight(p));
  par.for_each(par.ctx, transpose ? p.kb : p.cb, body, &args);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------
// x^T for updat's dense path
// ---------------------------------------------------------------------------------

struct TransposeArgs {
  const char* in;  // [rows, cols]
  char* out;       // [cols, rows]
  int64_t rows, cols;
};

// Output rows per work item, and the square tile moved at a time: a tile's input rows and
// output rows are 32 cache lines or fewer, all in L1 while it is moved.
constexpr int64_t kTransposeTile = 32;

// Output rows [t * 32, t * 32 + 32) (input columns), a 32 x 32 tile at a time down the
// input rows: transposed into a buffer, each input row's line read whole (the micro tiles
// across it in turn), then copied out a whole output line per row. Rows of a power-of-two
// length lie in the same cache sets: transposed straight into the output rows, which
// stay partly written across the tile, the same loop took 8-9x a copy's time (2-4x now).
template <int ITEM>
void TransposeBand(void* arg, int64_t t) {
  constexpr int64_t M = 16 / ITEM, T = kTransposeTile;
  const auto* a = static_cast<const TransposeArgs*>(arg);
  const int64_t R = a->rows, C = a->cols;
  const int64_t j0 = t * T, nj = j0 + T < C ? T : C - j0;
  alignas(64) char tile[T * T * ITEM];  // [j][i]
  for (int64_t i0 = 0; i0 < R; i0 += T) {
    const int64_t ni = i0 + T < R ? T : R - i0;
    const char* in = a->in + (i0 * C + j0) * ITEM;
    int64_t i = 0;
    for (; i + M <= ni; i += M) {
      int64_t j = 0;
      for (; j + M <= nj; j += M) TransposeMicro<ITEM>(in + (i * C + j) * ITEM, C, tile + (j * T + i) * ITEM, T);
      for (; j < nj; ++j)
        for (int64_t r = i; r < i + M; ++r) std::memcpy(tile + (j * T + r) * ITEM, in + (r * C + j) * ITEM, ITEM);
    }
    for (; i < ni; ++i)
      for (int64_t j = 0; j < nj; ++j) std::memcpy(tile + (j * T + i) * ITEM, in + (i * C + j) * ITEM, ITEM);
    for (int64_t j = 0; j < nj; ++j) std::memcpy(a->out + ((j0 + j) * R + i0) * ITEM, tile + j * T * ITEM, ni * ITEM);
  }
}

// out [C, R] = in [R, C] transposed (float32, float16 or bfloat16), row-major. updat's dense
// path computes x^T @ dy with x^T ready: XLA runs x.T @ dy slower than the dot of a
// row-major x^T, 2.5x in bfloat16 on a CPU's bfloat16 dot instructions and 1.2x in
// float32 (jax_blocksparse/ops/matmul.py, bsmm_updat_dense_cpu). XLA's own transpose
// feeding the dot is folded into it, and its copy under an optimization barrier still
// left the bfloat16 dot in float32.
ffi::Error TransposeImpl(ffi::ThreadPool pool, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = "jbs_transpose";
  const ffi::DataType dtype = in.element_type();
  const bool supported = dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16;
  auto id = in.dimensions();
  auto od = out->dimensions();
  if (!supported || out->element_type() != dtype || id.size() != 2 || od.size() != 2 || od[0] != id[1] ||
      od[1] != id[0]) {
    return Invalid(kOp, std::string("expects a 2-D float32, float16 or bfloat16 [R, C] and a result [C, R] of its "
                                    "dtype, got ") +
                            DtypeName(dtype) + " " + ShapeStr(in) + " and " + DtypeName(out->element_type()) + " " +
                            ShapeStr(*out));
  }
  TransposeArgs args{static_cast<const char*>(in.untyped_data()), static_cast<char*>(out->untyped_data()), id[0],
                     id[1]};
  if (args.rows == 0 || args.cols == 0) return ffi::Error::Success();
  cpu::AdviseHugePages(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  cpu::Parallel par = cpu::Workers(pool, args.rows * args.cols);
  par.for_each(par.ctx, (args.cols + kTransposeTile - 1) / kTransposeTile,
               dtype == ffi::DataType::F32 ? &TransposeBand<4> : &TransposeBand<2>, &args);
  return ffi::Error::Success();
}

// Version 1: W [C, K]. Version 2 is ToDense itself, with the attribute `transpose`.
ffi::Error ToDenseImpl(ffi::ThreadPool pool, ffi::AnyBuffer w, ffi::AnyBuffer block_rows, ffi::AnyBuffer block_cols,
                       ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr, ffi::AnyBuffer row_slots,
                       ffi::Result<ffi::AnyBuffer> dense) {
  return ToDense(pool, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, dense, false);
}

ffi::Error ToBlocksImpl(ffi::ThreadPool pool, ffi::AnyBuffer dense, ffi::AnyBuffer block_rows,
                        ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                        ffi::AnyBuffer row_slots, ffi::Result<ffi::AnyBuffer> w) {
  Placement p;
  if (ffi::Error e =
          Place("jbs_dense_to_blocks", *w, dense, block_rows, block_cols, col_ptr, row_ptr, row_slots, false, &p);
      e.failure()) {
    return e;
  }
  std::vector<int64_t> cell(static_cast<size_t>(p.cap), -1);
  const auto* rows = static_cast<const int32_t*>(block_rows.untyped_data());
  const auto* cols = static_cast<const int32_t*>(block_cols.untyped_data());
  for (int64_t s = 0; s < p.nnz; ++s) cell[s] = static_cast<int64_t>(rows[s]) * p.kb + cols[s];
  ToBlocksArgs args{&p, &cell, static_cast<const char*>(dense.untyped_data()), static_cast<char*>(w->untyped_data())};
  auto* body = Instance<ToBlocksBody>(p);
  if (body == nullptr)
    return ffi::Error::Internal("jbs_dense_to_blocks: no instance for block size " + std::to_string(p.bs));
  cpu::AdviseHugePages(w->untyped_data(), static_cast<int64_t>(w->size_bytes()));
  cpu::Parallel par = cpu::Workers(pool, Weight(p));
  const int64_t per = SlotsPerItem(static_cast<int>(p.bs));
  par.for_each(par.ctx, (p.cap + per - 1) / per, body, &args);
  return ffi::Error::Success();
}

// The blocks (or the dense matrix), then the five tables (bsmm_checks.h), after XLA's
// intra-op thread pool.
auto BindConversion() {
  using xla::ffi::AnyBuffer;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<AnyBuffer>()   // w [cap, bs, bs] (to dense), or W [C, K] (to blocks)
      .Arg<AnyBuffer>()   // block_rows [cap]
      .Arg<AnyBuffer>()   // block_cols [cap]
      .Arg<AnyBuffer>()   // col_ptr [KB + 1]
      .Arg<AnyBuffer>()   // row_ptr [CB + 1]
      .Arg<AnyBuffer>()   // row_slots [cap]
      .Ret<AnyBuffer>();  // W [C, K] (to dense), or w [cap, bs, bs] (to blocks)
}

}  // namespace
}  // namespace jbs

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBlocksToDenseCpu, jbs::ToDenseImpl, jbs::BindConversion());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBlocksToDenseCpuV2, jbs::ToDense, jbs::BindConversion().Attr<bool>("transpose"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsDenseToBlocksCpu, jbs::ToBlocksImpl, jbs::BindConversion());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsTransposeCpu, jbs::TransposeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()    // [R, C]
                                  .Ret<xla::ffi::AnyBuffer>());  // [C, R]
