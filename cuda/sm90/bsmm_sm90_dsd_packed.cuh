// sm_90a DSD kernel for small blocks (8, 16, 32): several output blocks per tile by
// block-diagonal packing, 16-bit inputs, or float32 inputs on TF32 GMMA (DispatchDsdPackedTF32).
//
// GMMA is efficient from N = 64 on, while one output block is only BS columns wide. So a
// tile packs P = 64 / BS output blocks (a group of the work plan: consecutive outputs
// of `order`, similar lengths, longest first) into 128 rows x 64 columns. Every k-step
// advances each member p by one of its layout entries: the A stage is [128, 64] made of
// P column slices, slice p = the BS columns of `a` member p's entry reads; the B stage
// is [64, 64] block-diagonal, diagonal block p = member p's W(slot), so
// A @ B = [A_0 W_0 | A_1 W_1 | ...]: each member's product in its own columns. The
// off-diagonal blocks of B are zeroed once when the CTA starts; TMA only ever writes
// the diagonal blocks. A member with no entry at a step (shorter than the group's
// longest, or a padding / out-of-range slot) loads both of its boxes from outside the
// tensors, which the TMA unit fills with zeros, so the transaction size of every stage
// is fixed and the member adds exactly zero. This spends P times the useful MMA work on
// the zero blocks in exchange for the wide, efficient GMMA shape.
//
// Roles, pipeline and epilogue as in bsmm_sm90_dsd.cuh; the epilogue stores each
// member's [128, BS] column slice with its own TMA store.
//
// Shared-memory layouts: every [128, BS] A slice, every [BS, BS] B block and every
// [128, BS] epilogue slice is one contiguous swizzle-atom tiling (the swizzle width is
// BS elements: 16/32/64 bytes in 16-bit, 32/64/128 bytes in TF32, AtomFor), so the TMA
// boxes land on whole atoms and the GMMA descriptors see canonical layouts.
//
// TF32 (T = tfloat32_t, float32 data and output): TF32 GMMA reads both operands K-major
// only, so B must be w read as bprop reads it (TRANS_W; fprop's lowering passes w with its
// blocks transposed). The stage stays [128, 64] x [64, 64] (the block diagonal ties stage K
// to tile N), i.e. 8 GMMA k8 steps per stage; 4 stages instead of 6 to fit shared memory.
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_PACKED_CUH_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_PACKED_CUH_

#include "sm90/bsmm_sm90_common.cuh"

namespace jbs {
namespace sm90 {
namespace detail {

template <typename T_, typename OutT_, int BS_, bool TRANS_W_>
struct DsdPackedConfig {
  using T = T_;
  using OutT = OutT_;
  static constexpr int kBs = BS_;
  static constexpr bool kTransW = TRANS_W_;
  static constexpr int kPack = 64 / kBs;  // members per tile (plan::DsdPackFor)
  static constexpr int kTileM = 128;
  static constexpr int kWidth = 64;                       // tile N and stage K
  static constexpr int kStages = sizeof(T) == 2 ? 6 : 4;  // TF32 stages are twice as big
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
  static_assert(kPack * kBs == kWidth, "block size must divide 64");
  static_assert(sizeof(T) == 2 || kTransW, "TF32 GMMA reads B K-major only: w must come as bprop reads it");

  using TileM = cute::Int<kTileM>;
  using Bs = cute::Int<kBs>;
  using Width = cute::Int<kWidth>;
  using Stages = cute::Int<kStages>;
  static constexpr cute::GMMA::Major kMajorB = kTransW ? cute::GMMA::Major::K : cute::GMMA::Major::MN;

  // A: K-major atoms BS wide, tiled M first: slice (stage, p) is contiguous. Two views of
  // the same memory: (128, 64, stage) for GMMA, (128, BS, stage * P + p) for TMA.
  using AtomA = AtomFor<T, cute::GMMA::Major::K, kBs>;
  using SmemLayoutA = decltype(cute::tile_to_shape(AtomA{}, cute::make_shape(TileM{}, Width{}, Stages{})));
  using SmemLayoutASlices =
      decltype(cute::tile_to_shape(AtomA{}, cute::make_shape(TileM{}, Bs{}, cute::Int<kStages * kPack>{})));
  using SliceA = decltype(cute::tile_to_shape(AtomA{}, cute::make_shape(TileM{}, Bs{})));  // one TMA box
  // B: [BS, BS] blocks (N, K), each one contiguous atom tiling; tiled N-block first, then
  // K-block, then stage. Views: (64, 64, stage) for GMMA, (BS, BS, (stage * P + q) * P + p).
  using BlockB = decltype(cute::tile_to_shape(AtomFor<T, kMajorB, kBs>{}, cute::make_shape(Bs{}, Bs{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(BlockB{}, cute::make_shape(Width{}, Width{}, Stages{})));
  using SmemLayoutBBlocks =
      decltype(cute::tile_to_shape(BlockB{}, cute::make_shape(Bs{}, Bs{}, cute::Int<kStages * kPack * kPack>{})));
  // Epilogue: (128, 64) for the MMA partition, (128, BS, p) for the TMA stores.
  using AtomC = AtomFor<OutT, cute::GMMA::Major::K, kBs>;
  using SmemLayoutC = decltype(cute::tile_to_shape(AtomC{}, cute::make_shape(TileM{}, Width{})));
  using SmemLayoutCSlices = decltype(cute::tile_to_shape(AtomC{}, cute::make_shape(TileM{}, Bs{}, cute::Int<kPack>{})));
  using SliceC = decltype(cute::tile_to_shape(AtomC{}, cute::make_shape(TileM{}, Bs{})));  // one TMA box

  using MmaOp = decltype(cute::GMMA::ss_op_selector<T, T, float, cute::Shape<cute::_64, Width, Width>,
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
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 limit");
  // Operand buffers at multiples of 1024 bytes (the SW128 repeat; CheckTmaBox), mbarriers 8-byte aligned.
  static_assert(offsetof(SharedStorage, a) % 1024 == 0 && offsetof(SharedStorage, b) % 1024 == 0 &&
                    offsetof(SharedStorage, c) % 1024 == 0,
                "operand buffers off 1024-byte alignment");
  static_assert(offsetof(SharedStorage, pipe) % 8 == 0 && alignof(typename Pipeline::SharedStorage) >= 8,
                "mbarriers must be 8-byte aligned");
  static constexpr uint32_t kStageBytes = kPack * (kTileM * kBs + kBs * kBs) * sizeof(T);

  // The same global views as DsdConfig (a as (M, K); w as (N, K); out as (M, N)).
  static auto GlobalA(const T* a, int n, int64_t lda) {
    return cute::make_tensor(cute::make_gmem_ptr(a), cute::make_shape(n, static_cast<int>(lda)),
                             cute::make_stride(lda, cute::_1{}));
  }
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
  static auto GlobalC(OutT* out, int n, int64_t ldc) {
    return cute::make_tensor(cute::make_gmem_ptr(out), cute::make_shape(n, static_cast<int>(ldc)),
                             cute::make_stride(ldc, cute::_1{}));
  }
  // The TMA boxes come from the unsliced atom tilings SliceA, BlockB, SliceC, never from
  // slices of the stage layouts: sliced, the float32 8 x 8 B block (256 bytes, SW32) lost
  // its swizzle (CheckTmaBox says how), and make_tma_copy split it into four unswizzled
  // 2-row boxes 64 bytes apart whose second TMA load faulted on the H100 ("misaligned
  // shared or local address") and whose layout GMMA would have misread anyway.
  using TmaA = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GlobalA(nullptr, 0, 0), SliceA{}));
  using TmaB = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GlobalB(nullptr, 0), BlockB{}));
  using TmaC = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GlobalC(nullptr, 0, 0), SliceC{}));
  static_assert(CheckTmaBox<T, TmaA, SliceA, AtomA>() && CheckTmaBox<T, TmaB, BlockB, AtomFor<T, kMajorB, kBs>>() &&
                CheckTmaBox<OutT, TmaC, SliceC, AtomC>());
};

template <class Cfg>
struct DsdPackedArgs {
  DsdParams p;
  plan::DsdPlan plan;
  typename Cfg::TmaA tma_a;
  typename Cfg::TmaB tma_b;
  typename Cfg::TmaC tma_c;
};

// A group's members as both roles see them: output block (or -1), entry range.
template <int P>
struct PackedGroup {
  int out[P];
  int start[P];
  int len[P];
  int steps;  // the longest member's length
};

template <int P>
__device__ __forceinline__ PackedGroup<P> LoadPackedGroup(const DsdParams& p, const plan::DsdPlan& pl, int group) {
  PackedGroup<P> g;
  g.steps = 0;
  const int members = plan::DsdGroupSize(pl, group);
  CUTE_UNROLL
  for (int m = 0; m < P; ++m) {
    g.out[m] = -1;
    g.start[m] = g.len[m] = 0;
    if (m < members) {
      const int o = __ldg(p.order + group * P + m);
      if (o >= 0 && o < p.nseg) {
        const int start = Clamp(__ldg(p.seg_ptr + o), 0, p.cap);
        const int end = Clamp(__ldg(p.seg_ptr + o + 1), start, p.cap);
        g.out[m] = o;
        g.start[m] = start;
        g.len[m] = end - start;
        g.steps = g.len[m] > g.steps ? g.len[m] : g.steps;
      }
    }
  }
  return g;
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    DsdPackedSm90Kernel(const __grid_constant__ DsdPackedArgs<Cfg> args) {
  using namespace cute;
  using T = typename Cfg::T;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  constexpr int BS = Cfg::kBs;
  constexpr int P = Cfg::kPack;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const DsdParams& p = args.p;
  const plan::DsdPlan& pl = args.plan;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  const int warp_in_group = (threadIdx.x / 32) % 4;

  // Zero the whole B buffer once: the off-diagonal blocks stay zero for the CTA's life.
  {
    uint4* b = reinterpret_cast<uint4*>(shared.b.data());
    constexpr int kVecs = static_cast<int>(cosize_v<typename Cfg::SmemLayoutB> * sizeof(T) / sizeof(uint4));
    for (int i = threadIdx.x; i < kVecs; i += Cfg::kThreads) b[i] = make_uint4(0u, 0u, 0u, 0u);
    cutlass::arch::fence_view_async_shared();  // generic-proxy zeros visible to GMMA
  }

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
  __syncthreads();

  const int n = static_cast<int>(p.n);
  const int64_t lda = static_cast<int64_t>(p.nin) * BS;
  const int64_t ldc = static_cast<int64_t>(p.nseg) * BS;
  const int nnz = Clamp(__ldg(p.nnz), 0, p.cap);
  const int64_t items = plan::DsdNumItems(pl);

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_group != 0 || !cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Cfg::SmemLayoutASlices{});
    Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Cfg::SmemLayoutBBlocks{});
    // (128, BS, m_tiles, in blocks) of a; (BS, BS, ., .) blocks of w.
    Tensor gA = local_tile(args.tma_a.get_tma_tensor(make_shape(n, static_cast<int>(lda))),
                           Shape<typename Cfg::TileM, typename Cfg::Bs>{}, make_coord(_, _));
    Tensor mB = [&] {
      if constexpr (Cfg::kTransW) {
        return args.tma_b.get_tma_tensor(make_shape(p.cap * BS, BS));
      } else {
        return args.tma_b.get_tma_tensor(make_shape(BS, p.cap * BS));
      }
    }();
    Tensor gB = local_tile(mB, Shape<typename Cfg::Bs, typename Cfg::Bs>{}, make_coord(_, _));
    auto [tAgA, tAsA] = tma_partition(args.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    auto [tBgB, tBsB] = tma_partition(args.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));

    PipelineState state = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
      const plan::DsdItem item = plan::DsdItemAt(pl, t);
      const PackedGroup<P> grp = LoadPackedGroup<P>(p, pl, item.group);
      for (int step = 0; step < grp.steps; ++step) {
        pipeline.producer_acquire(state);
        auto* barrier = pipeline.producer_get_barrier(state);
        const int stage = state.index();
        CUTE_UNROLL
        for (int m = 0; m < P; ++m) {
          // Out-of-range coordinates (one tile past the end) read zeros.
          int m_tile = pl.m_tiles, ib = 0, slot = p.cap;
          if (step < grp.len[m]) {
            int s, b;
            if (DsdEntrySource(p, nnz, grp.start[m] + step, &s, &b)) {
              m_tile = item.m_tile;
              ib = b;
              slot = s;
            }
          }
          copy(args.tma_a.with(*barrier), tAgA(_, m_tile, ib), tAsA(_, stage * P + m));
          const int diag = (stage * P + m) * P + m;
          if constexpr (Cfg::kTransW) {
            copy(args.tma_b.with(*barrier), tBgB(_, slot, 0), tBsB(_, diag));
          } else {
            copy(args.tma_b.with(*barrier), tBgB(_, 0, slot), tBsB(_, diag));
          }
        }
        ++state;
      }
    }
    pipeline.producer_tail(state);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int ctid = threadIdx.x - kWarpgroupThreads;
  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Cfg::SmemLayoutB{});
  Tensor sC = make_tensor(make_smem_ptr(shared.c.data()), typename Cfg::SmemLayoutC{});
  Tensor sCs = make_tensor(make_smem_ptr(shared.c.data()), typename Cfg::SmemLayoutCSlices{});
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(ctid);
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  Tensor accum = partition_fragment_C(mma, Shape<typename Cfg::TileM, typename Cfg::Width>{});
  Tensor tCsC = thr_mma.partition_C(sC);
  Tensor gC_all = local_tile(args.tma_c.get_tma_tensor(make_shape(n, static_cast<int>(ldc))),
                             Shape<typename Cfg::TileM, typename Cfg::Bs>{}, make_coord(_, _));
  auto tma_c_thr = args.tma_c.get_slice(0);
  const bool store_thread = ctid == 0;

  PipelineState read_state;
  PipelineState release_state;
  for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
    const plan::DsdItem item = plan::DsdItemAt(pl, t);
    const PackedGroup<P> grp = LoadPackedGroup<P>(p, pl, item.group);
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    int in_flight = 0;
    for (int step = 0; step < grp.steps; ++step) {
      pipeline.consumer_wait(read_state);
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        gemm(mma, tCrA(_, _, kb, read_state.index()), tCrB(_, _, kb, read_state.index()), accum);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      warpgroup_fence_operand(accum);
      if (in_flight) {
        pipeline.consumer_release(release_state);
        ++release_state;
      }
      in_flight = 1;
      ++read_state;
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    if (in_flight) {
      pipeline.consumer_release(release_state);
      ++release_state;
    } else {
      clear(accum);
    }

    if (store_thread) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(Cfg::kConsumers * kWarpgroupThreads, kEpilogueBarrier);
    StoreAccum(accum, tCsC);
    tma_store_fence();
    cutlass::arch::NamedBarrier::sync(Cfg::kConsumers * kWarpgroupThreads, kEpilogueBarrier);
    if (store_thread) {
      CUTE_UNROLL
      for (int m = 0; m < P; ++m) {
        if (grp.out[m] < 0) continue;
        copy(args.tma_c, tma_c_thr.partition_S(sCs(_, _, m)),
             tma_c_thr.partition_D(gC_all(_, _, item.m_tile, grp.out[m])));
      }
      tma_store_arrive();
    }
  }
  if (store_thread) tma_store_wait<0>();
}

template <class Cfg>
cudaError_t LaunchDsdPackedConfig(const DsdParams& p, const Launch& launch) {
  auto kernel = &DsdPackedSm90Kernel<Cfg>;
  if (launch.prepare_only) return PrepareKernel(kernel, Cfg::kSmemBytes);
  using T = typename Cfg::T;
  using OutT = typename Cfg::OutT;
  if (p.n > INT32_MAX - Cfg::kTileM || static_cast<int64_t>(p.nin) * Cfg::kBs > INT32_MAX ||
      static_cast<int64_t>(p.nseg) * Cfg::kBs > INT32_MAX || (static_cast<int64_t>(p.cap) + 1) * Cfg::kBs > INT32_MAX) {
    return cudaErrorInvalidValue;  // TMA coordinates are 32-bit
  }
  const int n = static_cast<int>(p.n);
  DsdPackedArgs<Cfg> args{
      p, plan::MakeDsdPlan(p.n, Cfg::kTileM, p.nseg, Cfg::kPack),
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Cfg::GlobalA(static_cast<const T*>(p.a), n, int64_t{p.nin} * Cfg::kBs),
                          typename Cfg::SliceA{}),
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Cfg::GlobalB(static_cast<const T*>(p.w), p.cap),
                          typename Cfg::BlockB{}),
      cute::make_tma_copy(cute::SM90_TMA_STORE{},
                          Cfg::GlobalC(static_cast<OutT*>(p.out), n, int64_t{p.nseg} * Cfg::kBs),
                          typename Cfg::SliceC{})};
  const int grid = plan::PersistentGrid(plan::DsdNumItems(args.plan), launch.num_sms > 0 ? launch.num_sms : 1, 1);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, launch.stream>>>(args);
  return cudaGetLastError();
}

template <typename T, typename OutT>
cudaError_t DispatchDsdPacked(bool transpose_w, const DsdParams& p, const Launch& launch) {
  switch (p.bs) {
    case 8:
      return transpose_w ? LaunchDsdPackedConfig<DsdPackedConfig<T, OutT, 8, true>>(p, launch)
                         : LaunchDsdPackedConfig<DsdPackedConfig<T, OutT, 8, false>>(p, launch);
    case 16:
      return transpose_w ? LaunchDsdPackedConfig<DsdPackedConfig<T, OutT, 16, true>>(p, launch)
                         : LaunchDsdPackedConfig<DsdPackedConfig<T, OutT, 16, false>>(p, launch);
    case 32:
      return transpose_w ? LaunchDsdPackedConfig<DsdPackedConfig<T, OutT, 32, true>>(p, launch)
                         : LaunchDsdPackedConfig<DsdPackedConfig<T, OutT, 32, false>>(p, launch);
    default: return cudaErrorInvalidValue;
  }
}

// float32 inputs on TF32 GMMA, float32 output, B read K-major (bprop's w, or fprop's w
// given transposed): blocks 8, 16 and 32. A template so that only the TU that calls it
// (bsmm_sm90_dsd_small_tf32.cu) compiles the kernels.
template <typename T = cutlass::tfloat32_t>
cudaError_t DispatchDsdPackedTF32(const DsdParams& p, const Launch& launch) {
  switch (p.bs) {
    case 8: return LaunchDsdPackedConfig<DsdPackedConfig<T, float, 8, true>>(p, launch);
    case 16: return LaunchDsdPackedConfig<DsdPackedConfig<T, float, 16, true>>(p, launch);
    case 32: return LaunchDsdPackedConfig<DsdPackedConfig<T, float, 32, true>>(p, launch);
    default: return cudaErrorInvalidValue;  // 64, 128: bsmm_sm90_dsd.cuh
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_PACKED_CUH_
