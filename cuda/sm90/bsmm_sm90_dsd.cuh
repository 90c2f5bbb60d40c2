// sm_90a DSD kernel (fprop, and bprop over the transposed tables): dense x block-sparse
// -> dense, for 16-bit inputs and, on TF32 tensor cores, float32 inputs (T =
// cutlass::tfloat32_t over float32 memory), for blocks of 64 or 128.
//
// Persistent and warp-specialized. The grid is about one CTA per SM; each CTA walks the
// items of the work plan (bsmm_work_plan.h: one item = 128 rows x one output block,
// longest outputs first). Per CTA, 384 threads:
//   warpgroup 0   producer: one elected thread reads the layout tables and issues, per
//                 k-step of 64 (32 for TF32: 128 bytes either way), two TMA loads into
//                 the next free pipeline stage: the 128 x 64 box of `a` at (m_tile,
//                 input block column) and the 64 x BS (fprop) / BS x 64 (bprop) box of
//                 w viewed as [cap * BS, BS] at the
//                 slot's rows. Rows past n are zero-filled by the TMA unit.
//   warpgroups 1-2 consumers: each owns 64 of the 128 rows and runs SM90 GMMA
//                 (64 x BS x 16, float32 accumulators) straight from shared memory,
//                 keeping one k-step of GMMAs in flight. The epilogue converts the
//                 accumulators into a shared tile that one thread stores with TMA
//                 (rows past n are clipped by the TMA unit).
// The stages are a cutlass::PipelineTmaAsync (full barriers with TMA transaction counts,
// empty barriers released by the consumers). An output block without entries runs no
// k-step: its tile is stored as zeros by the same TMA-store epilogue.
//
// Operand majors: a is K-major (rows of x/g are contiguous in k). For fprop the B
// operand W(s) = w[s] is [k, n] with n contiguous (MN-major, allowed for 16-bit GMMA);
// for bprop W(s) = w[s]^T, so B is K-major. TRANS_W_ only chooses how B is read
// (K-major from w[s] viewed as [n, k]); the tables come from DsdParams. TF32 GMMA
// (float32 inputs at DEFAULT/HIGH precision) needs a K-major B, so its fprop reads the
// blocks of w^T (the lowering passes jnp.swapaxes(w, -1, -2)) with TRANS_W_ = true over
// the fprop tables, exactly as bprop reads w. A k-step is then 32 elements (128 bytes)
// and each GMMA is 64 x BS x 8; the tensor cores use the top 19 bits of each float32
// (TF32), accumulating in float32.
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_CUH_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_CUH_

#include "sm90/bsmm_sm90_common.cuh"

namespace jbs {
namespace sm90 {
namespace detail {

template <typename T_, typename OutT_, int BS_, bool TRANS_W_>
struct DsdConfig {
  using T = T_;
  using OutT = OutT_;
  static constexpr int kBs = BS_;
  static constexpr bool kTransW = TRANS_W_;
  static constexpr int kTileM = 128;
  // 128 bytes of k, one 128-byte swizzle atom row: 64 16-bit elements, 32 tf32 ones.
  static constexpr int kTileK = 128 / static_cast<int>(sizeof(T));
  // TF32 GMMA reads both operands K-major only (no transposing smem descriptor for
  // 32-bit types): the w operand must then be given with its blocks K-major.
  static_assert(!cute::is_same_v<T, cutlass::tfloat32_t> || TRANS_W_, "TF32 needs a K-major B (transposed w blocks)");
  static constexpr int kStages = 4;
  static constexpr int kConsumers = 2;  // warpgroups, 64 rows each
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
  static constexpr int kKSteps = kBs / kTileK;  // k-steps per layout entry

  using TileM = cute::Int<kTileM>;
  using TileN = cute::Int<kBs>;
  using TileK = cute::Int<kTileK>;
  using Stages = cute::Int<kStages>;

  using SmemLayoutA =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<T>{}, cute::make_shape(TileM{}, TileK{}, Stages{})));
  using SmemAtomB =
      cute::conditional_t<kTransW, cute::GMMA::Layout_K_SW128_Atom<T>, cute::GMMA::Layout_MN_SW128_Atom<T>>;
  using SmemLayoutB = decltype(cute::tile_to_shape(SmemAtomB{}, cute::make_shape(TileN{}, TileK{}, Stages{})));
  // Epilogue tile: rows of the output contiguous in n, 128-byte swizzled against bank
  // conflicts (the TMA store unswizzles).
  using SmemLayoutC =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<OutT>{}, cute::make_shape(TileM{}, TileN{})));

  static constexpr cute::GMMA::Major kMajorB = kTransW ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  using MmaOp = decltype(cute::GMMA::ss_op_selector<T, T, float, cute::Shape<cute::_64, TileN, TileK>,
                                                    cute::GMMA::Major::K, kMajorB>());
  using TiledMma =
      decltype(cute::make_tiled_mma(MmaOp{}, cute::Layout<cute::Shape<cute::Int<kConsumers>, cute::_1, cute::_1>>{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    cute::array_aligned<T, cute::cosize_v<SmemLayoutA>, 1024> a;
    cute::array_aligned<T, cute::cosize_v<SmemLayoutB>, 1024> b;
    cute::array_aligned<OutT, cute::cosize_v<SmemLayoutC>, 1024> c;
    typename Pipeline::SharedStorage pipe;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 CTA may have");
  // Operand buffers at multiples of 1024 bytes (the SW128 repeat; CheckTmaBox), mbarriers 8-byte aligned.
  static_assert(offsetof(SharedStorage, a) % 1024 == 0 && offsetof(SharedStorage, b) % 1024 == 0 &&
                    offsetof(SharedStorage, c) % 1024 == 0,
                "operand buffers off 1024-byte alignment");
  static_assert(offsetof(SharedStorage, pipe) % 8 == 0 && alignof(typename Pipeline::SharedStorage) >= 8,
                "mbarriers must be 8-byte aligned");
  static constexpr uint32_t kStageBytes = (kTileM * kTileK + kBs * kTileK) * sizeof(T);

  // Global views the TMA descriptors are built from (shapes int32, strides int64).
  // a: [n, nin * BS] row-major, as (M, K).
  static auto GlobalA(const T* a, int n, int64_t lda) {
    return cute::make_tensor(cute::make_gmem_ptr(a), cute::make_shape(n, static_cast<int>(lda)),
                             cute::make_stride(lda, cute::_1{}));
  }
  // w as [cap * BS, BS] row-major, as (N, K): fprop B(n, k) = w2d[k][n]; bprop B(n, k) = w2d[n][k].
  static auto GlobalB(const T* w, int cap) {
    const int rows = cap * kBs;
    if constexpr (kTransW) {
      return cute::make_tensor(cute::make_gmem_ptr(w), cute::make_shape(rows, static_cast<int>(kBs)),
                               cute::make_stride(static_cast<int64_t>(kBs), cute::_1{}));
    } else {
      return cute::make_tensor(cute::make_gmem_ptr(w), cute::make_shape(static_cast<int>(kBs), rows),
                               cute::make_stride(cute::_1{}, static_cast<int64_t>(kBs)));
    }
  }
  // out: [n, nseg * BS] row-major, as (M, N).
  static auto GlobalC(OutT* out, int n, int64_t ldc) {
    return cute::make_tensor(cute::make_gmem_ptr(out), cute::make_shape(n, static_cast<int>(ldc)),
                             cute::make_stride(ldc, cute::_1{}));
  }
  using TmaA =
      decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GlobalA(nullptr, 0, 0), SmemLayoutA{}(cute::_, cute::_, 0)));
  using TmaB =
      decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GlobalB(nullptr, 0), SmemLayoutB{}(cute::_, cute::_, 0)));
  using TmaC = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GlobalC(nullptr, 0, 0), SmemLayoutC{}));
  static_assert(
      CheckTmaBox<T, TmaA, decltype(SmemLayoutA{}(cute::_, cute::_, 0)), cute::GMMA::Layout_K_SW128_Atom<T>>() &&
      CheckTmaBox<T, TmaB, decltype(SmemLayoutB{}(cute::_, cute::_, 0)), SmemAtomB>() &&
      CheckTmaBox<OutT, TmaC, SmemLayoutC, cute::GMMA::Layout_K_SW128_Atom<OutT>>());
};

template <class Cfg>
struct DsdArgs {
  DsdParams p;
  plan::DsdPlan plan;
  typename Cfg::TmaA tma_a;
  typename Cfg::TmaB tma_b;
  typename Cfg::TmaC tma_c;
};

// The output block and entry range of an item; false when `order` names no valid block.
__device__ __forceinline__ bool DsdItemOutput(const DsdParams& p, const plan::DsdPlan& pl, int64_t t,
                                              plan::DsdItem* item, int* out, int* start, int* end) {
  *item = plan::DsdItemAt(pl, t);
  const int o = __ldg(p.order + item->group);  // pack == 1 at blocks >= 64
  if (o < 0 || o >= p.nseg) return false;
  *out = o;
  *start = Clamp(__ldg(p.seg_ptr + o), 0, p.cap);
  *end = Clamp(__ldg(p.seg_ptr + o + 1), *start, p.cap);
  return true;
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) DsdSm90Kernel(const __grid_constant__ DsdArgs<Cfg> args) {
  using namespace cute;
  using T = typename Cfg::T;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  constexpr int BS = Cfg::kBs;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const DsdParams& p = args.p;
  const plan::DsdPlan& pl = args.plan;

  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  const int warp_in_group = (threadIdx.x / 32) % 4;

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Cfg::kStageBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Cfg::kConsumers * kWarpgroupThreads;
  Pipeline pipeline(shared.pipe, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(args.tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(args.tma_b.get_tma_descriptor());
    prefetch_tma_descriptor(args.tma_c.get_tma_descriptor());
  }
  __syncthreads();  // barriers initialised before any thread uses them

  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Cfg::SmemLayoutA{});  // (M, K, stage)
  Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Cfg::SmemLayoutB{});  // (N, K, stage)
  Tensor sC = make_tensor(make_smem_ptr(shared.c.data()), typename Cfg::SmemLayoutC{});  // (M, N)
  const int n = static_cast<int>(p.n);
  const int64_t lda = static_cast<int64_t>(p.nin) * BS;
  const int64_t ldc = static_cast<int64_t>(p.nseg) * BS;
  const int nnz = Clamp(__ldg(p.nnz), 0, p.cap);
  const int64_t items = plan::DsdNumItems(pl);

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_group != 0 || !cute::elect_one_sync()) return;
    // (M, K, m_tiles, k_tiles) coordinates of a; (N, K, n_tiles, k_tiles) of w.
    Tensor gA = local_tile(args.tma_a.get_tma_tensor(make_shape(n, static_cast<int>(lda))),
                           Shape<typename Cfg::TileM, typename Cfg::TileK>{}, make_coord(_, _));
    Tensor mB = [&] {
      if constexpr (Cfg::kTransW) {
        return args.tma_b.get_tma_tensor(make_shape(p.cap * BS, BS));
      } else {
        return args.tma_b.get_tma_tensor(make_shape(BS, p.cap * BS));
      }
    }();
    Tensor gB = local_tile(mB, Shape<typename Cfg::TileN, typename Cfg::TileK>{}, make_coord(_, _));
    auto [tAgA, tAsA] = tma_partition(args.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    auto [tBgB, tBsB] = tma_partition(args.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));

    PipelineState state = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
      plan::DsdItem item;
      int out, start, end;
      if (!DsdItemOutput(p, pl, t, &item, &out, &start, &end)) continue;
      for (int e = start; e < end; ++e) {
        int slot, ib;
        if (!DsdEntrySource(p, nnz, e, &slot, &ib)) continue;
        CUTE_UNROLL
        for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
          pipeline.producer_acquire(state);
          auto* barrier = pipeline.producer_get_barrier(state);
          const int stage = state.index();
          copy(args.tma_a.with(*barrier), tAgA(_, item.m_tile, ib * Cfg::kKSteps + kk), tAsA(_, stage));
          if constexpr (Cfg::kTransW) {
            copy(args.tma_b.with(*barrier), tBgB(_, slot, kk), tBsB(_, stage));
          } else {
            copy(args.tma_b.with(*barrier), tBgB(_, 0, slot * Cfg::kKSteps + kk), tBsB(_, stage));
          }
          ++state;
        }
      }
    }
    pipeline.producer_tail(state);  // do not exit while consumers still read our stages
    return;
  }

  // Consumers.
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int ctid = threadIdx.x - kWarpgroupThreads;  // 0..255
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(ctid);
  Tensor tCsA = thr_mma.partition_A(sA);
  Tensor tCsB = thr_mma.partition_B(sB);
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);  // GMMA descriptors
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor accum = partition_fragment_C(mma, Shape<typename Cfg::TileM, typename Cfg::TileN>{});
  Tensor tCsC = thr_mma.partition_C(sC);
  Tensor gC_all = local_tile(args.tma_c.get_tma_tensor(make_shape(n, static_cast<int>(ldc))),
                             Shape<typename Cfg::TileM, typename Cfg::TileN>{}, make_coord(_, _));
  auto tma_c_thr = args.tma_c.get_slice(0);
  Tensor tCsC_store = tma_c_thr.partition_S(sC);
  const bool store_thread = ctid == 0;

  PipelineState read_state;     // next stage to consume
  PipelineState release_state;  // oldest stage still read by an in-flight GMMA batch
  for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
    plan::DsdItem item;
    int out, start, end;
    if (!DsdItemOutput(p, pl, t, &item, &out, &start, &end)) continue;
    // The first k-step overwrites the accumulators (ScaleOut::Zero); a tile without
    // k-steps clears them below, so the GMMAs never wait on other writes to them.
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    int in_flight = 0;
    for (int e = start; e < end; ++e) {
      int slot, ib;
      if (!DsdEntrySource(p, nnz, e, &slot, &ib)) continue;
      CUTE_UNROLL
      for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
        pipeline.consumer_wait(read_state);
        warpgroup_fence_operand(accum);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {  // k16 blocks, one GMMA each
          gemm(mma, tCrA(_, _, kb, read_state.index()), tCrB(_, _, kb, read_state.index()), accum);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        // Keep this batch in flight; the previous one has finished reading its stage.
        warpgroup_wait<1>();
        warpgroup_fence_operand(accum);
        if (in_flight) {
          pipeline.consumer_release(release_state);
          ++release_state;
        }
        in_flight = 1;
        ++read_state;
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    if (in_flight) {
      pipeline.consumer_release(release_state);
      ++release_state;
    } else {
      clear(accum);  // an output block without entries: zeros
    }

    // Epilogue: the previous tile's TMA store must have read sC before it is rewritten.
    if (store_thread) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(Cfg::kConsumers * kWarpgroupThreads, kEpilogueBarrier);
    StoreAccum(accum, tCsC);
    tma_store_fence();  // make the generic-proxy writes visible to the TMA unit
    cutlass::arch::NamedBarrier::sync(Cfg::kConsumers * kWarpgroupThreads, kEpilogueBarrier);
    if (store_thread) {
      copy(args.tma_c, tCsC_store, tma_c_thr.partition_D(gC_all(_, _, item.m_tile, out)));
      tma_store_arrive();
    }
  }
  if (store_thread) tma_store_wait<0>();
}

// Host: builds the TMA descriptors and the plan, launches (or prepares) the kernel.
template <class Cfg>
cudaError_t LaunchDsdConfig(const DsdParams& p, const Launch& launch) {
  auto kernel = &DsdSm90Kernel<Cfg>;
  if (launch.prepare_only) return PrepareKernel(kernel, Cfg::kSmemBytes);
  using T = typename Cfg::T;
  using OutT = typename Cfg::OutT;
  if (p.n > INT32_MAX || static_cast<int64_t>(p.nin) * Cfg::kBs > INT32_MAX ||
      static_cast<int64_t>(p.nseg) * Cfg::kBs > INT32_MAX || static_cast<int64_t>(p.cap) * Cfg::kBs > INT32_MAX) {
    return cudaErrorInvalidValue;  // TMA coordinates are 32-bit
  }
  const int n = static_cast<int>(p.n);
  DsdArgs<Cfg> args{
      p, plan::MakeDsdPlan(p.n, Cfg::kTileM, p.nseg, 1),
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Cfg::GlobalA(static_cast<const T*>(p.a), n, int64_t{p.nin} * Cfg::kBs),
                          typename Cfg::SmemLayoutA{}(cute::_, cute::_, 0)),
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Cfg::GlobalB(static_cast<const T*>(p.w), p.cap),
                          typename Cfg::SmemLayoutB{}(cute::_, cute::_, 0)),
      cute::make_tma_copy(cute::SM90_TMA_STORE{},
                          Cfg::GlobalC(static_cast<OutT*>(p.out), n, int64_t{p.nseg} * Cfg::kBs),
                          typename Cfg::SmemLayoutC{})};
  const int grid = plan::PersistentGrid(plan::DsdNumItems(args.plan), launch.num_sms > 0 ? launch.num_sms : 1, 1);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, launch.stream>>>(args);
  return cudaGetLastError();
}

// float32 inputs on TF32 GMMA, float32 output, B read K-major (bprop's w, or fprop's
// w given transposed): blocks 64 and 128 (8/16/32: bsmm_sm90_dsd_packed.cuh).
inline cudaError_t DispatchDsdTF32(const DsdParams& p, const Launch& launch) {
  using T = cutlass::tfloat32_t;  // same bits as float32
  switch (p.bs) {
    case 64: return LaunchDsdConfig<DsdConfig<T, float, 64, true>>(p, launch);
    case 128: return LaunchDsdConfig<DsdConfig<T, float, 128, true>>(p, launch);
    default: return cudaErrorInvalidValue;  // 8, 16, 32: DispatchDsdPackedTF32
  }
}

// Dispatch over the block size (64, 128) and the direction for one dtype pair.
template <typename T, typename OutT>
cudaError_t DispatchDsd(bool transpose_w, const DsdParams& p, const Launch& launch) {
  switch (p.bs) {
    case 64:
      return transpose_w ? LaunchDsdConfig<DsdConfig<T, OutT, 64, true>>(p, launch)
                         : LaunchDsdConfig<DsdConfig<T, OutT, 64, false>>(p, launch);
    case 128:
      return transpose_w ? LaunchDsdConfig<DsdConfig<T, OutT, 128, true>>(p, launch)
                         : LaunchDsdConfig<DsdConfig<T, OutT, 128, false>>(p, launch);
    default: return cudaErrorInvalidValue;  // 8, 16, 32: bsmm_sm90_dsd_packed.cuh
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_CUH_
