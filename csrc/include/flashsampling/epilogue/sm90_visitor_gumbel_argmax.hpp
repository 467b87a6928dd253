/*! \file
  \brief Epilogue-visitor-tree node: Gumbel-Max sampling over the M (vocabulary) mode.

  The GEMM computes logits[v, b] = W[v, :] . h[b, :] with the vocabulary on M and
  the batch on N. This node sits at the root of the tree over Sm90AccFetch:

    Sm90EVT<Sm90GumbelArgmaxRowReduction<CtaTileShapeMNK>, Sm90AccFetch>

  While an accumulator tile is in registers it perturbs every logit with the
  Philox Gumbel noise of its global (batch row, vocab index), keeps the best
  (score, index) per batch column and writes one packed candidate per
  (vocabulary tile, batch column) to a workspace; kernels/reduce_candidates.cu
  reduces those to one token per row. No logits reach global memory.

  Layout and reduction choreography follow Sm90RowReduction
  (sm90_visitor_store_tma_warpspecialized.hpp), which also reduces over M and
  emits one value per N column: per-thread registers aliased over M (stride-0
  modes), a warp-shuffle stage over the lanes that share a column, a
  shared-memory stage over the warps stacked in M, then a global write. Two
  differences: the reduced value is a (score, index) pair packed into 64 bits,
  and the cross-thread stages run once per epilogue column strip (epi_n) instead
  of once per tile, so each thread keeps state only for the columns of one
  strip; that keeps the register budget flat at batch 256.

  kLoop selects which element loop the node is compiled with (sampler_loop.h,
  SamplerLoop). The plain loop serves one sample with a batch-wide temperature and
  seed and nothing else. The common controls' loop adds what serving engines send
  every step: per-row temperatures (T = 0: greedy), a dense logit bias and the
  allowed-token mask transform each logit before the noise (after the model-side
  scale and soft-cap, which the controls' loops apply; the penalties of the row's seen
  tokens follow the biases there), and with logprobs the
  node also keeps an online (max, sum of exp) per column in log2 units and the
  transformed logit of each column's best candidate, reduced alongside. The loop for
  all controls adds sparse per-row bias, per-row seeds and offsets and several
  samples per pass (column s * B + b draws sample s of row b, so the weight tile is
  read once for all of them). The top-candidates loop keeps each column's best few
  transformed logits instead of drawing noise. They are separate kernels because the
  epilogue inlines visit() once per subtile: code of a loop that is not taken still
  costs instruction cache (docs/epilogue.md). For the same reason every step of
  visit() and reduce() below is CUTLASS_DEVICE (force-inlined): a step is a name
  for a piece of the one inlined loop, not a call.
*/
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/fast_math.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

#include "flashsampling/epilogue/candidate_math.cuh"
#include "flashsampling/philox_gumbel.h"
#include "flashsampling/sampler_params.h"

namespace flashsampling::epilogue {

using namespace cute;
using cutlass::epilogue::fusion::ConsumerStoreArgs;
using cutlass::epilogue::fusion::ProducerLoadArgs;
using cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks;
using cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks;
using cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue;

// The noise of N elements of a thread's fragment, element j keyed by (seed[j], offset +
// sample[j], vocab index v[j], stream[j]) as in fs_gumbel_noise, for the loops of the wide
// plain tiles and of the controls kernels. One element at a time the noise is a serial chain
// (Philox rounds, then two logs) and the epilogue, with two warps per scheduler, stalls on it
// (ncu at B = 128: issue on 31% of cycles, most stalls fixed-latency dependencies). Here the
// Philox blocks of the even elements run side by side, then (when any odd element needs its
// own) those of the odd elements, and the N Gumbel transforms step by step across the
// elements (fs_gumbel_from_bits_lanes). An odd element reuses the block of the element
// before it when they share every key but stream & 3, as neighbouring columns of the wgmma
// accumulator layout do at a batch-wide seed: the same bits as fs_gumbel_noise for every
// element, in any fragment order. noise_bits_lanes stops at the Philox bits.
template <int N>
CUTLASS_DEVICE void noise_bits_lanes(uint64_t const (&seed)[N], uint64_t const (&offset_plus_sample)[N],
                                     uint32_t const (&v)[N], uint32_t const (&stream)[N], uint32_t (&bits)[N]) {
  static_assert(N % 2 == 0, "elements come in pairs");
  Philox4 block[N];
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < N; j += 2) {
    block[j] = fs_noise_block(seed[j], offset_plus_sample[j], v[j], stream[j] >> 2);
  }
  bool shares[N];
  bool all_share = true;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 1; j < N; j += 2) {
    shares[j] = seed[j] == seed[j - 1] && offset_plus_sample[j] == offset_plus_sample[j - 1] && v[j] == v[j - 1] &&
                (stream[j] >> 2) == (stream[j - 1] >> 2);
    all_share = all_share && shares[j];
  }
  if (all_share) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 1; j < N; j += 2) block[j] = block[j - 1];
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 1; j < N; j += 2) {
      block[j] = shares[j] ? block[j - 1] : fs_noise_block(seed[j], offset_plus_sample[j], v[j], stream[j] >> 2);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < N; ++j) {
    bits[j] = fs_philox_lane(block[j], stream[j] & 3u);
  }
}

template <int N>
CUTLASS_DEVICE void gumbel_noise_lanes(uint64_t const (&seed)[N], uint64_t const (&offset_plus_sample)[N],
                                       uint32_t const (&v)[N], uint32_t const (&stream)[N], float (&gumbel)[N]) {
  uint32_t bits[N];
  noise_bits_lanes<N>(seed, offset_plus_sample, v, stream, bits);
  fs_gumbel_from_bits_lanes<N>(bits, gumbel);
}

// Out of line: scalars in, registers out (no stack frame). Eight elements per call are no
// faster than four (docs/epilogue.md), so the loops take four.
static __device__ __noinline__ float4 gumbel_noise_x4_out_of_line(uint64_t seed, uint64_t offset_plus_sample,
                                                                  uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3,
                                                                  uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  uint64_t const seeds[4] = {seed, seed, seed, seed};
  uint64_t const offsets[4] = {offset_plus_sample, offset_plus_sample, offset_plus_sample, offset_plus_sample};
  uint32_t const v[4] = {v0, v1, v2, v3}, r[4] = {r0, r1, r2, r3};
  float g[4];
  gumbel_noise_lanes<4>(seeds, offsets, v, r, g);
  return make_float4(g[0], g[1], g[2], g[3]);
}

// The noise of four elements at the batch-wide seed and offset (GEMM column = batch row = noise
// stream), for the wide plain loop and the common controls' loop; zeros for a greedy batch.
CUTLASS_DEVICE float4 batch_noise_x4(bool greedy, uint64_t seed, uint64_t offset, uint32_t const (&vocab_index)[4],
                                     uint32_t const (&batch_row)[4]) {
  if (greedy) {
    return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  return gumbel_noise_x4_out_of_line(seed, offset, vocab_index[0], vocab_index[1], vocab_index[2], vocab_index[3],
                                     batch_row[0], batch_row[1], batch_row[2], batch_row[3]);
}

// The noise of one vocab index in the four streams of a quad (batch rows 4q .. 4q + 3 at the
// batch-wide seed): one Philox block, its four Gumbel transforms side by side. Out of line, as
// the wide tiles' loops call theirs: inlined into every subtile's unrolled loop, this code
// crowds the instruction cache and slows the whole GEMM (docs/truncation.md has the A/B).
static __device__ __noinline__ float4 quad_noise_x4_out_of_line(uint64_t seed, uint64_t offset_plus_sample,
                                                                uint32_t v, uint32_t quad) {
  Philox4 const block = fs_noise_block(seed, offset_plus_sample, v, quad);
  uint32_t const bits[4] = {block.x, block.y, block.z, block.w};
  float g[4];
  fs_gumbel_from_bits_lanes<4>(bits, g);
  return make_float4(g[0], g[1], g[2], g[3]);
}

// The same with a key per element (per-row seeds / offsets, several samples per pass).
static __device__ __noinline__ float4 gumbel_noise_keyed_x4_out_of_line(
    uint64_t s0, uint64_t s1, uint64_t s2, uint64_t s3, uint64_t o0, uint64_t o1, uint64_t o2, uint64_t o3,
    uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3, uint32_t t0, uint32_t t1, uint32_t t2, uint32_t t3) {
  uint64_t const seeds[4] = {s0, s1, s2, s3}, offsets[4] = {o0, o1, o2, o3};
  uint32_t const v[4] = {v0, v1, v2, v3}, streams[4] = {t0, t1, t2, t3};
  float g[4];
  gumbel_noise_lanes<4>(seeds, offsets, v, streams, g);
  return make_float4(g[0], g[1], g[2], g[3]);
}

CUTLASS_DEVICE bool bitmap_test(uint32_t const* bitmap, int64_t row_words, uint32_t row, uint32_t index) {
  return (__ldg(bitmap + row * row_words + (index >> 5)) >> (index & 31u)) & 1u;
}

// x + the row's sparse bias of v (the sum of its entries for v, in entry order) where the sparse
// bitmap marks (row, v); x unchanged elsewhere. vocab_local must be inside the vocabulary.
CUTLASS_DEVICE float add_sparse_bias(SamplingControls const& c, uint32_t batch_row, uint32_t vocab_local,
                                     uint32_t vocab_index, float x) {
  if (!bitmap_test(c.sparse_bitmap, c.mask_words, batch_row, vocab_local)) {
    return x;
  }
  float sum = 0.0f;
  int32_t const* ids = c.sparse_ids + static_cast<int64_t>(batch_row) * c.sparse_k;
  float const* values = c.sparse_values + static_cast<int64_t>(batch_row) * c.sparse_k;
  for (int k = 0; k < c.sparse_k; ++k) {
    if (__ldg(ids + k) == static_cast<int32_t>(vocab_index)) {
      sum = fs_add(sum, __ldg(values + k));
    }
  }
  return fs_add(x, sum);
}

// x through the penalties of row `row`'s seen tokens (fs_penalized_logit), x unchanged where the
// row has not seen v: one load of the rank bitmap's word pair, and for a seen token one of its
// slot (SamplingControls::penalty_words). row and vocab_local must be inside the problem.
CUTLASS_DEVICE float penalized_logit(SamplingControls const& c, uint32_t row, uint32_t vocab_local, float x) {
  uint2 const words =
      __ldg(reinterpret_cast<uint2 const*>(c.penalty_words) + row * c.mask_words + (vocab_local >> 5));
  uint32_t const bit = vocab_local & 31u;
  if (!((words.x >> bit) & 1u)) {
    return x;
  }
  uint32_t const rank = words.y + __popc(words.x & ((1u << bit) - 1u));
  float2 const slot = __ldg(reinterpret_cast<float2 const*>(c.penalty_slots) +
                            static_cast<int64_t>(row) * c.penalty_capacity + rank);
  return fs_penalized_logit(x, slot.x, slot.y);
}

// x = fl(fl(logit + logit_bias[v]) + sparse sum); false when the mask excludes v.
CUTLASS_DEVICE bool transform_logit(SamplingControls const& c, uint32_t batch_row, uint32_t vocab_local,
                                    uint32_t vocab_index, float& x) {
  if (c.allowed_mask && !bitmap_test(c.allowed_mask, c.mask_words, batch_row, vocab_local)) {
    return false;
  }
  if (c.logit_bias) {
    x = fs_add(x, __ldg(c.logit_bias + vocab_local));
  }
  if (c.sparse_bitmap) {
    x = add_sparse_bias(c, batch_row, vocab_local, vocab_index, x);
  }
  return true;
}

// The allowed-mask words and dense biases of a fragment's elements (all-allowed / 0 where not
// given), loaded together before the loop that uses them, so that their latency (L2: the mask
// of a tile is new data) is waited for once per fragment (ncu: the mask test after each noise
// call was the top stall of the common controls' loop). The mask row's address is computed
// once per column: `strip` aliases a column's rows to one slot, so a later element's write
// makes the earlier one dead. Out-of-range elements read in-range entries and are not kept.
template <int FragmentSize, class CoordTensor, class StripLayout>
CUTLASS_DEVICE void load_mask_words_and_biases(SamplingControls const& controls, CoordTensor const& tCcD_mn, int epi_v,
                                               int m_origin, int n_origin, uint32_t last_row, uint32_t last_vocab,
                                               StripLayout const& strip, uint32_t (&mask_word)[FragmentSize],
                                               float (&bias)[FragmentSize]) {
  Tensor tCrMaskRow = make_tensor<uint32_t const*>(strip);
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < FragmentSize; ++k) {
    int const frg_idx = epi_v * FragmentSize + k;
    uint32_t const row = min(static_cast<uint32_t>(n_origin + get<1>(tCcD_mn(frg_idx))), last_row);
    tCrMaskRow(frg_idx) = controls.allowed_mask + row * controls.mask_words;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < FragmentSize; ++k) {
    int const frg_idx = epi_v * FragmentSize + k;
    uint32_t const v = min(static_cast<uint32_t>(m_origin + get<0>(tCcD_mn(frg_idx))), last_vocab);
    mask_word[k] = controls.allowed_mask ? __ldg(tCrMaskRow(frg_idx) + (v >> 5)) : ~0u;
    bias[k] = controls.logit_bias ? __ldg(controls.logit_bias + v) : 0.0f;
  }
}

constexpr float kLog2e = 1.4426950408889634f;

// The fragment's raw logits as floats, through the model-side transforms where the call has any
// (fs_model_logit: scale, then soft-cap). One warp-uniform branch per fragment, ahead of the
// element loop, so the loop itself is the same code with or without them.
template <typename ElementInput, int FragmentSize>
CUTLASS_DEVICE void model_logits(SamplingControls const& controls,
                                 cutlass::Array<ElementInput, FragmentSize> const& frg_logits,
                                 float (&logit)[FragmentSize]) {
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < FragmentSize; ++k) logit[k] = static_cast<float>(frg_logits[k]);
  if (controls.logit_scale != 1.0f || controls.logit_softcap != 0.0f) {
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < FragmentSize; ++k) {
      logit[k] = fs_model_logit(logit[k], controls.logit_scale, controls.logit_softcap, controls.inv_logit_softcap);
    }
  }
}

// A thread's running best of one column: replaced when (score, vocab_index) is better.
CUTLASS_DEVICE bool keep_better_candidate(float score, uint32_t vocab_index, float& best_score, int32_t& best_index) {
  if (!fs_candidate_better(score, static_cast<int32_t>(vocab_index), best_score, best_index)) {
    return false;
  }
  best_score = score;
  best_index = static_cast<int32_t>(vocab_index);
  return true;
}

// ElementOutput: what visit() hands on to the collective. With ElementD = void
// (sm90) nothing is stored and the collective takes its shared-memory element from
// ElementAux; the reduce() stage reuses that epilogue buffer as scratch, as
// Sm90RowReduction does. Where a D store cannot be switched off (sm100 in CUTLASS
// 4.2), ElementOutput is the scratch D element and visit() emits zeros.
template <class CtaTileShapeMNK, class ElementOutput = float, SamplerLoop kLoop = SamplerLoop::kPlain>
struct Sm90GumbelArgmaxRowReduction {
  using ElementAux = ElementOutput;
  // Tiles with N >= 64 call the noise out of line: the collective unrolls every epilogue
  // subtile, so inlined noise grows the kernel with N until it no longer fits the instruction
  // cache (at N = 128 out of line is about twice as fast; at N = 64 the same either way:
  // docs/epilogue.md).
  static constexpr bool kNoiseOutOfLine = decltype(size<1>(CtaTileShapeMNK{}))::value >= 64;
  // The top-k pass on sm90, whose visit() hands fp32 values to reduce(): each subtile's
  // transformed logits go through the epilogue's shared-memory buffer and every thread scans a
  // run of rows of one column, so a column's four best are merged over a few threads once per
  // strip (reduce_top_candidates_scan). Where visit() can only return the scratch D element
  // (sm100), the lists stay per thread over the accumulator layout (reduce_top_candidates),
  // which merges over every lane and warp of a column, about twice plain sampling's time at
  // B = 256 (docs/truncation.md).
  static constexpr bool kTopScan = kLoop == SamplerLoop::kTopCandidates && cute::is_same_v<ElementOutput, float>;
  // visit()'s encoding of a token the mask excludes (or past the problem), as the fused
  // truncation stores it (candidate_math.cuh).
  static constexpr uint32_t kExcludedBits = kExcludedLogitBits;
  // The plain loop of narrow tiles (visit_plain) may store the logits for the plain pass of a
  // truncation call up to 32 rows (Arguments::ptr_tile_max_logits), behind a branch.
  static constexpr bool kStoresPlainLogits = kLoop == SamplerLoop::kPlain && !kNoiseOutOfLine;

  struct SharedStorage {};

  struct Arguments {
    // Outputs per (vocabulary tile, GEMM column): [ceil(M / CTA_M)][N]. With S samples
    // the GEMM has N = S * B columns, column s * B + b holding batch row b (the binding
    // repeats hidden S times), and the node draws sample s there: the weight tile is
    // read once for all samples and only the noise/argmax work repeats.
    PackedCandidate* ptr_candidates = nullptr;
    float* ptr_candidate_logits = nullptr;  // y of each candidate (logprobs only)
    float2* ptr_lse_parts = nullptr;        // (max2, sum) of each column (logprobs, or row_logits)
    // The fused truncation's rows that stage 2 may leave to the logits sampler (kTopScan): every x
    // goes to row_logits[row * row_logits_stride + v] as visit() encodes it, and each (tile, row)'s
    // log-mass of y = x / T to ptr_lse_parts (top_p without top_k needs the row's). Also the plain
    // pass's stored x (kStoresPlainLogits, with ptr_tile_max_logits).
    float* ptr_row_logits = nullptr;
    int64_t row_logits_stride = 0;
    // SamplerParams::row_logits_by_top_k: each row's top_k ([B]), whose rows that stage 2 decides
    // from the candidates alone get no stored x (scan_stores_row_logits); null: every row's x.
    int64_t const* ptr_row_top_ks = nullptr;
    // SamplerParams::draw_tile_winners (kTopScan, one sample, the batch-wide noise key): each
    // (tile, row)'s plain-sampling winner over the tile, pack_candidate of its perturbed score and
    // index (0: none), at [m_tile * N + column].
    PackedCandidate* ptr_tile_winners = nullptr;
    // SamplerParams::truncation_on_plain_pass (the epilogue-warpgroup kernel's plain and controls'
    // loops, and this visitor's plain loop of narrow tiles: kStoresPlainLogits): each (tile,
    // column)'s largest raw logit at [tile * N + column], next to every x stored in ptr_row_logits
    // (columns below batch_size).
    float* ptr_tile_max_logits = nullptr;
    // SamplerParams::large_top_k_run_keys (the epilogue-warpgroup kernel's top-k scan only, without
    // ptr_row_logits): each 16-token run's four largest keys at [row * run_keys_stride + run * 4].
    PackedCandidate* ptr_run_keys = nullptr;
    int64_t run_keys_stride = 0;
    NoiseSource noise = {};
    SamplingControls controls = {};
    float inv_temperature = 1.0f;
    bool greedy = false;
    bool logprobs = false;
    int num_samples = 1;        // S
    uint32_t batch_size = 0;    // B: GEMM column c is batch row c % B, sample c / B
    cutlass::FastDivmod batch_divmod{};  // c -> (c / B, c % B) without a division (set with batch_size)
    uint32_t vocab_start = 0;   // global id of row 0 of M
  };

  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    // A loop ignores the controls it was not built for: refuse a call that needs them.
    SamplerLoop const needed = sampler_loop_for(args.controls, args.noise, args.num_samples, args.logprobs);
    return args.ptr_candidates != nullptr && args.num_samples >= 1 && args.batch_size >= 1 &&
           static_cast<int>(needed) <= static_cast<int>(kLoop) &&
           (kLoop != SamplerLoop::kTopCandidates ||
            (args.controls.sparse_ids == nullptr && args.controls.logit_scale == 1.0f &&
             args.controls.logit_softcap == 0.0f && args.controls.penalty_ids == nullptr)) &&
           (args.ptr_row_logits == nullptr || (kTopScan && args.ptr_lse_parts != nullptr) ||
            args.ptr_tile_max_logits != nullptr) &&
           (args.ptr_tile_max_logits == nullptr ||
            (kStoresPlainLogits && args.ptr_row_logits != nullptr && args.num_samples == 1 && !args.logprobs)) &&
           (args.ptr_tile_winners == nullptr ||
            (kTopScan && args.num_samples == 1 && !args.logprobs && args.noise.row_seeds == nullptr &&
             args.noise.row_offsets == nullptr && args.noise.row_streams == nullptr)) &&
           args.ptr_run_keys == nullptr &&  // (only the epilogue-warpgroup kernel's scan stores them)
           (!args.logprobs || (args.ptr_candidate_logits != nullptr && args.ptr_lse_parts != nullptr));
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90GumbelArgmaxRowReduction() {}

  CUTLASS_HOST_DEVICE Sm90GumbelArgmaxRowReduction(Params const& params, SharedStorage const&)
      : params(params) {}

  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(ProducerLoadArgs<Args...> const&) {
    return EmptyProducerLoadCallbacks{};
  }

  // The fields of ConsumerStoreCallbacks::args_tuple, in the order get_consumer_store_callbacks
  // packs them; ConsumerStoreCallbacks::arg<I>() reads one.
  enum StoreArg : int {
    kReferenceSrc,   // bool_constant: the epilogue partitions like its source (true) or like D
    kScore,          // per strip column: the running best score...
    kIndex,          // ...and its vocab index
    kLogit,          // the transformed logit of that best (logprobs)
    kLseMax,         // the online log-sum-exp's max (log2 units, logprobs)...
    kLseSum,         // ...and sum of exp
    kCoordD,         // coordinates of the thread's accumulators, (CPY, CPY_M, CPY_N, EPI_M, EPI_N)
    kResidueCoordD,  // how far the problem extends past the thread's first coordinate
    kProblemMN,      // (M, N) of the problem
    kLaneLayoutMN,   // (M, N) -> lane of the epilogue's warps
    kLaneMN,         // this lane's (M, N) position
    kWarpLayoutMN,   // (M, N) -> warp
    kWarpMN,         // this warp's (M, N) position
    kTileCoordMNKL,  // the CTA tile's coordinate
    kEpiTile,        // the epilogue subtile's shape
    kTiledCopy,      // the epilogue's register <-> shared-memory copy
    kThreadIdx,      // thread index in the epilogue
    kTop,            // the top-k pass's per-thread lists (kTopCandidatesPerTile keys per strip slot)
    kNumStoreArgs
  };

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, Params const& params)
        : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params) {}

    ArgsTuple args_tuple;
    Params const& params;
    uint64_t seed = 0;
    uint64_t offset = 0;
    PackedCandidate scan_top[kTopCandidatesPerTile] = {};  // the top-k scan's list (kTopScan)
    float scan_lse_max2 = -INFINITY, scan_lse_sum = 0.0f;    // and its log-mass (ptr_row_logits)
    float winner_score[4];                                    // and its quad's tile winners (ptr_tile_winners)
    int32_t winner_index[4];

    // The one place that reads args_tuple's fields: each step takes the ones it uses. A
    // reference to a field, or (cute::get of an empty type, e.g. a static shape) its value.
    template <StoreArg I>
    CUTLASS_DEVICE decltype(auto) arg() {
      return get<I>(args_tuple);
    }

    // The epilogue's static geometry, from the fields' types.
    template <StoreArg I>
    using ArgType = remove_cvref_t<decltype(get<I>(declval<ArgsTuple&>()))>;
    static constexpr bool ReferenceSrc = ArgType<kReferenceSrc>::value;
    static constexpr int EpiM = decltype(size<3>(declval<ArgType<kCoordD>>()))::value;  // subtiles per strip
    static constexpr int EpiTileM = decltype(size<0>(declval<ArgType<kEpiTile>>()))::value;
    static constexpr int EpiTileN = decltype(size<1>(declval<ArgType<kEpiTile>>()))::value;
    static constexpr int WarpsM = decltype(size<0>(declval<ArgType<kWarpLayoutMN>>()))::value;
    static constexpr int NumThreads = ArgType<kTiledCopy>::TiledNumThr::value;

    CUTLASS_DEVICE void begin() {
      resolve_noise_source(params.noise, seed, offset);
      reset_strip();
    }

    CUTLASS_DEVICE void reset_strip() {
      if constexpr (kLoop == SamplerLoop::kTopCandidates) {
        fill(arg<kTop>(), PackedCandidate{0});
        return;
      }
      fill(arg<kScore>(), -INFINITY);
      fill(arg<kIndex>(), int32_t{kNoCandidate});
      if (stores_plain_logits()) fill(arg<kLseMax>(), -INFINITY);  // the strip columns' largest x
      if (kLoop != SamplerLoop::kPlain && params.logprobs) {
        fill(arg<kLogit>(), 0.0f);
        fill(arg<kLseMax>(), -INFINITY);
        fill(arg<kLseSum>(), 0.0f);
      }
    }

    // Whether this plain loop stores the logits and keeps each strip column's largest
    // (kStoresPlainLogits, where the call asks: the plain pass up to 32 rows).
    CUTLASS_DEVICE bool stores_plain_logits() const {
      return kStoresPlainLogits && params.ptr_tile_max_logits != nullptr;
    }

    // The running best of the strip column that fragment slot frg_idx belongs to (registers
    // alias over M: rows of one column share a slot); true when (score, vocab_index) replaced it.
    CUTLASS_DEVICE bool keep_better(int frg_idx, float score, uint32_t vocab_index) {
      return keep_better_candidate(score, vocab_index, arg<kScore>()(frg_idx), arg<kIndex>()(frg_idx));
    }

    // One element loop per kLoop (see the file comment for why each is a kernel of its own).
    // Each step gets the fragment, its index epi_v in the subtile, the subtile's coordinates and
    // the origin that turns a coordinate into an absolute (vocabulary, column) position.
    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m,
                              int epi_n, cutlass::Array<ElementInput, FragmentSize> const& frg_logits) {
      auto&& residue_tCcD = arg<kResidueCoordD>();
      auto&& problem_mn = arg<kProblemMN>();
      Tensor tCcD_mn = arg<kCoordD>()(_, _, _, epi_m, epi_n);
      // Absolute coordinate = problem extent - residue of this thread + relative coordinate.
      int const m_origin = get<0>(problem_mn) - get<0>(residue_tCcD);
      int const n_origin = get<1>(problem_mn) - get<1>(residue_tCcD);
      if constexpr (kTopScan) {
        // The scan's reduce() takes its input from what visit() returns.
        return visit_top_candidates(frg_logits, epi_v, tCcD_mn, m_origin, n_origin);
      } else {
        if constexpr (kLoop == SamplerLoop::kPlain && kNoiseOutOfLine) {
          visit_plain_batched_noise(frg_logits, epi_v, tCcD_mn, m_origin, n_origin);
        } else if constexpr (kLoop == SamplerLoop::kPlain) {
          visit_plain(frg_logits, epi_v, tCcD_mn, m_origin, n_origin);
        } else if constexpr (kLoop == SamplerLoop::kCommonControls) {
          visit_common_controls(frg_logits, epi_v, tCcD_mn, m_origin, n_origin);
        } else if constexpr (kLoop == SamplerLoop::kTopCandidates) {
          visit_top_candidates(frg_logits, epi_v, tCcD_mn, m_origin, n_origin);
        } else {
          visit_all_controls(frg_logits, epi_v, tCcD_mn, m_origin, n_origin);
        }
        if constexpr (cute::is_same_v<ElementOutput, ElementInput>) {
          return frg_logits;
        } else {
          cutlass::Array<ElementOutput, FragmentSize> zeros;
          zeros.fill(ElementOutput(0));
          return zeros;
        }
      }
    }

    // The plain loop of wide tiles: the noise of four elements per call, their chains side by
    // side (gumbel_noise_lanes); out-of-range elements draw noise too, and are dropped at the
    // compare.
    template <typename ElementInput, int FragmentSize, class CoordTensor>
    CUTLASS_DEVICE void visit_plain_batched_noise(cutlass::Array<ElementInput, FragmentSize> const& frg_logits,
                                                  int epi_v, CoordTensor const& tCcD_mn, int m_origin, int n_origin) {
      auto&& residue_tCcD = arg<kResidueCoordD>();
      static_assert(FragmentSize % 4 == 0, "the wide tiles' loop takes fragments four elements at a time");
      constexpr int kGroup = 4;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += kGroup) {
        uint32_t vocab_index[kGroup], batch_row[kGroup];
        bool in_range[kGroup];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kGroup; ++j) {
          auto const coord = tCcD_mn(epi_v * FragmentSize + i + j);
          in_range[j] = elem_less(coord, residue_tCcD);
          vocab_index[j] = params.vocab_start + static_cast<uint32_t>(m_origin + get<0>(coord));
          batch_row[j] = static_cast<uint32_t>(n_origin + get<1>(coord));
        }
        float4 const g = batch_noise_x4(params.greedy, seed, offset, vocab_index, batch_row);
        float const gumbel[kGroup] = {g.x, g.y, g.z, g.w};
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kGroup; ++j) {
          int const frg_idx = epi_v * FragmentSize + i + j;
          float const logit = static_cast<float>(frg_logits[i + j]);
          float const score = params.greedy ? logit : fs_perturbed_score(logit, params.inv_temperature, gumbel[j]);
          if (in_range[j]) {
            keep_better(frg_idx, score, vocab_index[j]);
          }
        }
      }
    }

    // The plain loop of narrow tiles, noise inlined: one Philox block holds the noise of 4
    // consecutive batch rows at one vocab index; accumulator layouts keep neighbouring columns
    // in neighbouring fragment slots (wgmma: pairs, tcgen05: runs), so reuse the last block.
    template <typename ElementInput, int FragmentSize, class CoordTensor>
    CUTLASS_DEVICE void visit_plain(cutlass::Array<ElementInput, FragmentSize> const& frg_logits, int epi_v,
                                    CoordTensor const& tCcD_mn, int m_origin, int n_origin) {
      auto&& residue_tCcD = arg<kResidueCoordD>();
      static_assert(!kNoiseOutOfLine, "wide tiles take the four-element loop (fragments of a multiple of four)");
      uint64_t const offset_plus_sample = offset;
      uint32_t block_vocab = ~0u, block_quad = ~0u;
      Philox4 block{};
      bool const stores = stores_plain_logits();
      uint64_t const keep_in_l2 = stores ? l2_evict_last_policy() : 0ull;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        int const frg_idx = epi_v * FragmentSize + i;
        auto const coord = tCcD_mn(frg_idx);
        if (elem_less(coord, residue_tCcD)) {
          uint32_t const vocab_index = params.vocab_start + static_cast<uint32_t>(m_origin + get<0>(coord));
          uint32_t const batch_row = static_cast<uint32_t>(n_origin + get<1>(coord));
          float const logit = static_cast<float>(frg_logits[i]);
          if (stores) store_plain_logit(frg_idx, batch_row, m_origin + get<0>(coord), logit, keep_in_l2);
          float score = logit;
          if (!params.greedy) {
            if (vocab_index != block_vocab || (batch_row >> 2) != block_quad) {
              block = fs_noise_block(seed, offset_plus_sample, vocab_index, batch_row >> 2);
              block_vocab = vocab_index;
              block_quad = batch_row >> 2;
            }
            uint32_t const bits = fs_philox_lane(block, batch_row & 3u);
            float const gumbel = fs_gumbel_from_bits(bits);
            score = fs_perturbed_score(logit, params.inv_temperature, gumbel);
          }
          keep_better(frg_idx, score, vocab_index);
        }
      }
    }

    // The plain pass's store of one x (stores_plain_logits): to the row's stored logits as the
    // top-k scan stores them (top_scan_value; the plain loop has no mask), with the L2 evict_last
    // policy, and into the strip column's largest. Padding columns (past batch_size) have no row.
    CUTLASS_DEVICE void store_plain_logit(int frg_idx, uint32_t batch_row, int vocab_local, float logit,
                                          uint64_t l2_policy) {
      if (batch_row >= params.batch_size) return;
      store_with_l2_policy(params.ptr_row_logits + static_cast<int64_t>(batch_row) * params.row_logits_stride +
                               vocab_local,
                           top_scan_value(logit, true), l2_policy);
      arg<kLseMax>()(frg_idx) = fmaxf(arg<kLseMax>()(frg_idx), logit);
    }

    // The common controls' loop: the plain loop of wide tiles plus the controls' few operations
    // per element, without branches, so that its code stays close to the plain loop's (the loop
    // for all controls is several times larger than the plain loop and waits on instruction
    // fetch where it runs wide tiles: docs/epilogue.md).
    template <typename ElementInput, int FragmentSize, class CoordTensor>
    CUTLASS_DEVICE void visit_common_controls(cutlass::Array<ElementInput, FragmentSize> const& frg_logits, int epi_v,
                                              CoordTensor const& tCcD_mn, int m_origin, int n_origin) {
      auto&& residue_tCcD = arg<kResidueCoordD>();
      auto&& problem_mn = arg<kProblemMN>();
      static_assert(FragmentSize % 4 == 0, "the controls loop takes fragments four elements at a time");
      SamplingControls const& controls = params.controls;
      uint32_t const last_row = params.batch_size - 1;
      uint32_t const last_vocab = static_cast<uint32_t>(get<0>(problem_mn)) - 1;
      // Per-column values, one load per column: the strip layout aliases the rows of a column
      // to one slot, so a later element's write makes the earlier load dead. Out-of-range
      // elements read in-range entries (never past the arrays) and are not kept.
      Tensor tCrInvT = make_tensor<float>(arg<kScore>().layout());
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < FragmentSize; ++k) {
        int const frg_idx = epi_v * FragmentSize + k;
        uint32_t const row = min(static_cast<uint32_t>(n_origin + get<1>(tCcD_mn(frg_idx))), last_row);
        // fl(1 / T) of the row; 0 marks a greedy row.
        tCrInvT(frg_idx) = row_inv_temperature(controls, row, params.greedy ? 0.0f : params.inv_temperature);
      }
      uint32_t mask_word[FragmentSize];
      float bias[FragmentSize];
      load_mask_words_and_biases(controls, tCcD_mn, epi_v, m_origin, n_origin, last_row, last_vocab,
                                 arg<kScore>().layout(), mask_word, bias);
      float logit[FragmentSize];
      model_logits(controls, frg_logits, logit);
      // The penalties come after the dense bias (docs/penalties.md): with them the bias is added
      // here, and both behind one warp-uniform branch per fragment, so the element loop below is
      // the same code without them.
      bool const penalties = controls.penalty_words != nullptr;
      if (penalties) {
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < FragmentSize; ++k) {
          auto const coord = tCcD_mn(epi_v * FragmentSize + k);
          uint32_t const vocab_local = min(static_cast<uint32_t>(m_origin + get<0>(coord)), last_vocab);
          uint32_t const row = min(static_cast<uint32_t>(n_origin + get<1>(coord)), last_row);
          float const x = controls.logit_bias ? fs_add(logit[k], bias[k]) : logit[k];
          logit[k] = penalized_logit(controls, row, vocab_local, x);
        }
      }
      bool const add_bias = controls.logit_bias && !penalties;
      constexpr int kGroup = 4;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += kGroup) {
        uint32_t vocab_index[kGroup], batch_row[kGroup];
        float x[kGroup];
        bool keep[kGroup];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kGroup; ++j) {
          int const frg_idx = epi_v * FragmentSize + i + j;
          auto const coord = tCcD_mn(frg_idx);
          uint32_t const vocab_local = static_cast<uint32_t>(m_origin + get<0>(coord));
          vocab_index[j] = params.vocab_start + vocab_local;
          batch_row[j] = static_cast<uint32_t>(n_origin + get<1>(coord));
          x[j] = logit[i + j];
          if (add_bias) {
            x[j] = fs_add(x[j], bias[i + j]);
          }
          keep[j] = elem_less(coord, residue_tCcD) && ((mask_word[i + j] >> (vocab_local & 31u)) & 1u);
        }
        // Per-row greedy rows draw noise they do not use.
        float4 const g = batch_noise_x4(params.greedy, seed, offset, vocab_index, batch_row);
        float const gumbel[kGroup] = {g.x, g.y, g.z, g.w};
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kGroup; ++j) {
          int const frg_idx = epi_v * FragmentSize + i + j;
          float const inv_temperature = tCrInvT(frg_idx);
          bool const greedy = inv_temperature == 0.0f;
          // Transformed logit of the log-probabilities: x / T, or x for greedy rows.
          float const y = greedy ? x[j] : fs_mul(x[j], inv_temperature);
          float score = greedy ? x[j] : fs_perturbed_score(x[j], inv_temperature, gumbel[j]);
          // Out of range, or masked out: no candidate (a NaN score never wins), no mass.
          score = keep[j] ? score : __int_as_float(0x7fc00000);
          if (params.logprobs) {
            lse_add(arg<kLseMax>()(frg_idx), arg<kLseSum>()(frg_idx), y * kLog2e, keep[j]);
          }
          if (keep_better(frg_idx, score, vocab_index[j])) {
            arg<kLogit>()(frg_idx) = y;
          }
        }
      }
    }

    // The fused top-k pass: no noise here (stage 2 draws it for the survivors only). Each
    // element's transformed logit x (dense bias; masked or out of range: key 0) goes into its
    // column's descending list of kTopCandidatesPerTile keys, branch-free. With kTopScan the
    // lists are kept by reduce_top_candidates_scan instead, from the fp32 values returned here
    // (x, or kExcludedBits for an element not kept).
    template <typename ElementInput, int FragmentSize, class CoordTensor>
    CUTLASS_DEVICE auto visit_top_candidates(cutlass::Array<ElementInput, FragmentSize> const& frg_logits, int epi_v,
                                             CoordTensor const& tCcD_mn, int m_origin, int n_origin) {
      auto&& tCrTop = arg<kTop>();
      auto&& residue_tCcD = arg<kResidueCoordD>();
      auto&& problem_mn = arg<kProblemMN>();
      static_assert(FragmentSize % 4 == 0, "the top-k loop takes fragments four elements at a time");
      SamplingControls const& controls = params.controls;
      cutlass::Array<ElementOutput, FragmentSize> encoded;
      uint32_t const last_row = params.batch_size - 1;
      uint32_t const last_vocab = static_cast<uint32_t>(get<0>(problem_mn)) - 1;
      uint32_t mask_word[FragmentSize];
      float bias[FragmentSize];
      load_mask_words_and_biases(controls, tCcD_mn, epi_v, m_origin, n_origin, last_row, last_vocab,
                                 arg<kScore>().layout(), mask_word, bias);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        int const frg_idx = epi_v * FragmentSize + i;
        auto const coord = tCcD_mn(frg_idx);
        uint32_t const vocab_local = static_cast<uint32_t>(m_origin + get<0>(coord));
        float x = static_cast<float>(frg_logits[i]);
        if (controls.logit_bias) {
          x = fs_add(x, bias[i]);
        }
        bool const keep = elem_less(coord, residue_tCcD) && ((mask_word[i] >> (vocab_local & 31u)) & 1u);
        if constexpr (kTopScan) {
          encoded[i] = top_scan_value(x, keep);
          continue;
        }
        PackedCandidate const key = keep ? pack_top_candidate(x, params.vocab_start + vocab_local) : 0;
        PackedCandidate top[kTopCandidatesPerTile];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kTopCandidatesPerTile; ++j) top[j] = tCrTop(frg_idx, j);
        insert_top_candidate(top, key);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kTopCandidatesPerTile; ++j) tCrTop(frg_idx, j) = top[j];
      }
      if constexpr (kTopScan) {
        return encoded;
      }
    }

    // The loop for all controls, four elements at a time like the plain loop of wide tiles:
    // transform and per-row values of the four, one noise call for them (skipped when none is
    // kept or all are greedy), then log-sum-exp and compare.
    template <typename ElementInput, int FragmentSize, class CoordTensor>
    CUTLASS_DEVICE void visit_all_controls(cutlass::Array<ElementInput, FragmentSize> const& frg_logits, int epi_v,
                                           CoordTensor const& tCcD_mn, int m_origin, int n_origin) {
      auto&& residue_tCcD = arg<kResidueCoordD>();
      static_assert(FragmentSize % 4 == 0, "the controls loop takes fragments four elements at a time");
      SamplingControls const& controls = params.controls;
      NoiseSource const& src = params.noise;
      bool const transform = controls.logit_bias || controls.allowed_mask || controls.sparse_bitmap;
      bool const penalties = controls.penalty_words != nullptr;
      uint32_t const last_row = params.batch_size - 1;
      float logit[FragmentSize];
      model_logits(controls, frg_logits, logit);
      constexpr int kGroup = 4;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += kGroup) {
        uint32_t vocab_index[kGroup], stream[kGroup];
        uint64_t row_seed[kGroup], row_offset[kGroup];
        float x[kGroup], inv_temperature[kGroup];
        bool keep[kGroup], greedy[kGroup];
        bool any_noise = false;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kGroup; ++j) {
          auto const coord = tCcD_mn(epi_v * FragmentSize + i + j);
          bool const in_range = elem_less(coord, residue_tCcD);
          uint32_t const vocab_local = static_cast<uint32_t>(m_origin + get<0>(coord));
          vocab_index[j] = params.vocab_start + vocab_local;
          uint32_t const column = static_cast<uint32_t>(n_origin + get<1>(coord));
          uint32_t const sample = params.num_samples == 1 ? 0u : column / params.batch_size;
          // Out-of-range elements read row 0's values (never past the arrays) and are not kept.
          uint32_t const batch_row = in_range ? column - sample * params.batch_size : 0u;
          x[j] = logit[i + j];
          keep[j] = in_range && (!transform || transform_logit(controls, batch_row, vocab_local, vocab_index[j], x[j]));
          // After the biases (docs/penalties.md). Kept: inside the vocabulary, but with one sample
          // the padding columns of a ragged N tile (launch_sampler's padded_columns, GEMM columns
          // of their own) are in range with a batch row past B: their word pair would be read
          // past the rank bitmap and its garbage prefix count would send the slot load anywhere.
          // Clamped (their candidates are never read).
          if (penalties && keep[j]) {
            x[j] = penalized_logit(controls, min(batch_row, last_row), vocab_local, x[j]);
          }
          // (launch_sampler prepares the [B] array for this loop: a load per element, no division)
          inv_temperature[j] = params.inv_temperature;
          greedy[j] = params.greedy;
          if (controls.inv_temperatures) {
            inv_temperature[j] = __ldg(controls.inv_temperatures + batch_row);
            greedy[j] = inv_temperature[j] == 0.0f;
          }
          RowNoiseKey const key = row_noise_key(src, seed, offset, batch_row, sample);
          row_seed[j] = key.seed;
          row_offset[j] = key.offset;
          stream[j] = key.stream;
          any_noise = any_noise || (keep[j] && !greedy[j]);
        }
        float4 g = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (any_noise) {
          g = gumbel_noise_keyed_x4_out_of_line(row_seed[0], row_seed[1], row_seed[2], row_seed[3], row_offset[0],
                                                row_offset[1], row_offset[2], row_offset[3], vocab_index[0],
                                                vocab_index[1], vocab_index[2], vocab_index[3], stream[0], stream[1],
                                                stream[2], stream[3]);
        }
        float const gumbel[kGroup] = {g.x, g.y, g.z, g.w};
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kGroup; ++j) {
          if (!keep[j]) {
            continue;  // out of range, or masked out: no candidate, no probability mass
          }
          int const frg_idx = epi_v * FragmentSize + i + j;
          // Transformed logit of the log-probabilities: x / T, or x for greedy rows.
          float const y = greedy[j] ? x[j] : fs_mul(x[j], inv_temperature[j]);
          if (params.logprobs) {
            lse_add(arg<kLseMax>()(frg_idx), arg<kLseSum>()(frg_idx), y * kLog2e);
          }
          float const score = greedy[j] ? x[j] : fs_perturbed_score(x[j], inv_temperature[j], gumbel[j]);
          if (keep_better(frg_idx, score, vocab_index[j])) {
            arg<kLogit>()(frg_idx) = y;
          }
        }
      }
    }

    // Once per subtile for the top-k scan (it consumes each subtile's values); otherwise once
    // per column strip, after its last subtile: the epilogue walks epi_m fastest.
    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&& smem_buffer, SyncFn const& sync_fn, int epi_m, int epi_n,
                               bool is_last_iteration, VTensor visit_results) {
      if constexpr (kTopScan) {
        reduce_top_candidates_scan(smem_buffer, sync_fn, epi_m, epi_n, visit_results);
      } else {
        if (epi_m != EpiM - 1) {
          return;
        }
        auto [m_tile, n_tile, k_tile, l_tile] = arg<kTileCoordMNKL>();
        int const num_cols = get<1>(arg<kProblemMN>());
        int const col_base = static_cast<int>(n_tile) * size<1>(CtaTileShapeMNK{}) + epi_n * EpiTileN;
        if constexpr (kLoop == SamplerLoop::kTopCandidates) {
          reduce_top_candidates(smem_buffer, sync_fn, col_base, num_cols, m_tile);
        } else {
          reduce_argmax(smem_buffer, sync_fn, col_base, num_cols, m_tile);
        }
        reset_strip();
      }
    }

    // The argmax's reduce of a strip: the running bests (and with logprobs the log-sum-exp
    // parts and the bests' logits) merged over the lanes that share a column, then over the
    // warps stacked in M through shared memory; one candidate per column goes to the workspace.
    template <class STensor, class SyncFn, class MTile>
    CUTLASS_DEVICE void reduce_argmax(STensor&& smem_buffer, SyncFn const& sync_fn, int col_base, int num_cols,
                                      MTile m_tile) {
      int64_t const out_base = static_cast<int64_t>(m_tile) * num_cols + col_base;
      bool const logprobs = kLoop != SamplerLoop::kPlain && params.logprobs;

      // Shared-memory scratch, one entry per (strip column, warp in M): candidates,
      // then the candidates' logits, then the (max2, sum) pairs. Each is a
      // (EPI_TILE_M, EPI_TILE_N, WARPS_M) layout with stride 0 over EPI_TILE_M, the
      // shape the epilogue partitioner takes.
      auto sBuf_layout = make_layout(make_shape(Int<EpiTileM>{}, Int<EpiTileN>{}, Int<WarpsM>{}),
                                     make_stride(_0{}, _1{}, Int<EpiTileN>{}));
      constexpr int kEntries = EpiTileN * WarpsM;
      static_assert(kEntries * (sizeof(PackedCandidate) + sizeof(float) + sizeof(float2)) <=
                        decltype(cosize(smem_buffer.layout()))::value *
                            sizeof(typename remove_cvref_t<STensor>::value_type),
                    "epilogue smem buffer too small for the candidate reduction");
      char* smem = reinterpret_cast<char*>(raw_pointer_cast(smem_buffer.data()));
      Tensor sCand = make_tensor(make_smem_ptr(reinterpret_cast<PackedCandidate*>(smem)), sBuf_layout);
      Tensor sLogit = make_tensor(make_smem_ptr(reinterpret_cast<float*>(smem + kEntries * sizeof(PackedCandidate))),
                                  sBuf_layout);
      Tensor sLse = make_tensor(
          make_smem_ptr(reinterpret_cast<float2*>(smem + kEntries * (sizeof(PackedCandidate) + sizeof(float)))),
          sBuf_layout);

      // The log-sum-exp of each column (once per strip, not per sample); or the plain pass's
      // largest x of each column.
      if (logprobs) {
        merge_lse_over_lanes();
      }
      bool const tile_max = stores_plain_logits();
      if (tile_max) {
        merge_max_over_lanes();
      }

      // 1. Pack this thread's distinct columns and reduce over the lanes that share them.
      Tensor tCrScore_flt = filter(arg<kScore>());
      Tensor tCrIndex_flt = filter(arg<kIndex>());
      Tensor tCrLogit_flt = filter(arg<kLogit>());
      constexpr int NumCols = decltype(size(tCrScore_flt))::value;
      PackedCandidate packed[NumCols];
      float logit[NumCols];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < NumCols; ++i) {
        packed[i] = pack_candidate(tCrScore_flt(i), tCrIndex_flt(i));
        logit[i] = tCrLogit_flt(i);
      }
      merge_candidates_over_lanes(packed, logit, logprobs);

      // 2. Lanes at M position 0 hold their warp's result: stage it per warp in shared memory.
      sync_fn();  // the previous readers are done with the scratch
      stage_warp_candidates(sCand, sLogit, sLse, packed, logit, logprobs, tile_max);
      sync_fn();

      // 3. Reduce over the warps stacked in M and write one candidate per column.
      write_column_candidates(sCand, sLogit, sLse, col_base, num_cols, out_base, m_tile, logprobs, tile_max);
    }

    // merge(lane_delta) for each step of a tree over the lanes that share this thread's columns
    // (the lane `lane_delta` below holds the other half at that step).
    template <class MergeFn>
    CUTLASS_DEVICE void for_each_lane_step(MergeFn&& merge) {
      auto&& lane_layout_MN = arg<kLaneLayoutMN>();
      CUTLASS_PRAGMA_UNROLL
      for (int rows = size<0>(lane_layout_MN) / 2; rows > 0; rows /= 2) merge(lane_layout_MN(rows, _0{}));
    }

    // The online (max2, sum) pairs of this thread's distinct columns, merged over the lanes
    // that share them.
    CUTLASS_DEVICE void merge_lse_over_lanes() {
      Tensor tCrLseMax_flt = filter(arg<kLseMax>());
      Tensor tCrLseSum_flt = filter(arg<kLseSum>());
      constexpr int NumCols = decltype(size(tCrLseMax_flt))::value;
      for_each_lane_step([&](int lane_delta) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NumCols; ++i) {
          float const other_max = __shfl_down_sync(0xFFFFFFFF, tCrLseMax_flt(i), lane_delta);
          float const other_sum = __shfl_down_sync(0xFFFFFFFF, tCrLseSum_flt(i), lane_delta);
          lse_merge(tCrLseMax_flt(i), tCrLseSum_flt(i), other_max, other_sum);
        }
      });
    }

    // The plain pass's largest x of this thread's distinct columns (kLseMax), merged over the
    // lanes that share them.
    CUTLASS_DEVICE void merge_max_over_lanes() {
      Tensor tCrMax_flt = filter(arg<kLseMax>());
      constexpr int NumCols = decltype(size(tCrMax_flt))::value;
      for_each_lane_step([&](int lane_delta) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NumCols; ++i) {
          tCrMax_flt(i) = fmaxf(tCrMax_flt(i), __shfl_down_sync(0xFFFFFFFF, tCrMax_flt(i), lane_delta));
        }
      });
    }

    // A tree over the lanes that share a column: the larger packed candidate wins, its logit
    // (logprobs) travels with it. Lanes at M position 0 end with the warp's best.
    template <int NumCols>
    CUTLASS_DEVICE void merge_candidates_over_lanes(PackedCandidate (&packed)[NumCols], float (&logit)[NumCols],
                                                    bool logprobs) {
      for_each_lane_step([&](int lane_delta) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NumCols; ++i) {
          PackedCandidate const other = __shfl_down_sync(0xFFFFFFFF, packed[i], lane_delta);
          float const other_logit = logprobs ? __shfl_down_sync(0xFFFFFFFF, logit[i], lane_delta) : 0.0f;
          if (other > packed[i]) {
            packed[i] = other;
            logit[i] = other_logit;
          }
        }
      });
    }

    // Lanes at M position 0 write their warp's bests (and logits and log-sum-exp parts) to
    // the warp's slot of the shared-memory scratch.
    template <class CandTensor, class LogitTensor, class LseTensor, int NumCols>
    CUTLASS_DEVICE void stage_warp_candidates(CandTensor& sCand, LogitTensor& sLogit, LseTensor& sLse,
                                              PackedCandidate const (&packed)[NumCols],
                                              float const (&logit)[NumCols], bool logprobs, bool tile_max) {
      auto&& lane_mn = arg<kLaneMN>();
      auto&& warp_mn = arg<kWarpMN>();
      auto&& epi_tile = arg<kEpiTile>();
      auto&& tiled_copy = arg<kTiledCopy>();
      auto&& thread_idx = arg<kThreadIdx>();
      if (get<0>(lane_mn) == 0) {
        Tensor tCsCand = filter(
            sm90_partition_for_epilogue<ReferenceSrc>(sCand(_, _, get<0>(warp_mn)), epi_tile, tiled_copy, thread_idx));
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NumCols; ++i) {
          tCsCand(i) = packed[i];
        }
        if (logprobs) {
          Tensor tCsLogit = filter(sm90_partition_for_epilogue<ReferenceSrc>(sLogit(_, _, get<0>(warp_mn)), epi_tile,
                                                                             tiled_copy, thread_idx));
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < NumCols; ++i) {
            tCsLogit(i) = logit[i];
          }
          Tensor tCsLse = filter(sm90_partition_for_epilogue<ReferenceSrc>(sLse(_, _, get<0>(warp_mn)), epi_tile,
                                                                           tiled_copy, thread_idx));
          Tensor tCrLseMax_flt = filter(arg<kLseMax>());
          Tensor tCrLseSum_flt = filter(arg<kLseSum>());
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < NumCols; ++i) {
            tCsLse(i) = make_float2(tCrLseMax_flt(i), tCrLseSum_flt(i));
          }
        }
        if (tile_max) {  // the plain pass's largest x, in the log-sum-exp parts' place (no logprobs)
          Tensor tCsLse = filter(sm90_partition_for_epilogue<ReferenceSrc>(sLse(_, _, get<0>(warp_mn)), epi_tile,
                                                                           tiled_copy, thread_idx));
          Tensor tCrMax_flt = filter(arg<kLseMax>());
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < NumCols; ++i) {
            tCsLse(i) = make_float2(tCrMax_flt(i), 0.0f);
          }
        }
      }
    }

    // One thread per column of the strip merges the warps' entries and writes the column's
    // candidate (and its logit and log-sum-exp parts). A tile wholly past the vocabulary (a
    // cluster's tile count is rounded up to the cluster size) has no row in the workspace.
    template <class CandTensor, class LogitTensor, class LseTensor, class MTile>
    CUTLASS_DEVICE void write_column_candidates(CandTensor const& sCand, LogitTensor const& sLogit,
                                                LseTensor const& sLse, int col_base, int num_cols, int64_t out_base,
                                                MTile m_tile, bool logprobs, bool tile_max) {
      auto&& problem_mn = arg<kProblemMN>();
      auto&& tiled_copy = arg<kTiledCopy>();
      auto&& thread_idx = arg<kThreadIdx>();
      bool const tile_in_problem = static_cast<int>(m_tile) * size<0>(CtaTileShapeMNK{}) < get<0>(problem_mn);
      for (int col = thread_idx; tile_in_problem && col < EpiTileN; col += size(tiled_copy)) {
        if (col_base + col >= num_cols) {
          continue;
        }
        PackedCandidate best = sCand(0, col, 0);
        float best_logit = logprobs ? sLogit(0, col, 0) : 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int w = 1; w < WarpsM; ++w) {
          PackedCandidate const c = sCand(0, col, w);
          if (c > best) {
            best = c;
            best_logit = logprobs ? sLogit(0, col, w) : 0.0f;
          }
        }
        params.ptr_candidates[out_base + col] = best;
        if (logprobs) {
          params.ptr_candidate_logits[out_base + col] = best_logit;
          float2 lse = sLse(0, col, 0);
          CUTLASS_PRAGMA_UNROLL
          for (int w = 1; w < WarpsM; ++w) {
            float2 const other = sLse(0, col, w);
            lse_merge(lse.x, lse.y, other.x, other.y);
          }
          params.ptr_lse_parts[out_base + col] = lse;
        }
        if (tile_max) {
          float largest = sLse(0, col, 0).x;
          CUTLASS_PRAGMA_UNROLL
          for (int w = 1; w < WarpsM; ++w) largest = fmaxf(largest, sLse(0, col, w).x);
          params.ptr_tile_max_logits[out_base + col] = largest;
        }
      }
    }

    // The top-k pass's reduce on sm90, every subtile: its fp32 values (visit()'s encoding) go to
    // the shared-memory buffer, column-major; thread t then scans rows [r * kRun, (r + 1) * kRun)
    // of column c = t / kScanners (r = t % kScanners), keeping its four best across the subtiles
    // of the strip in `scan_top`. After the strip's last subtile the kScanners threads of a
    // column (neighbouring lanes) merge their lists by shuffles and the first writes them.
    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce_top_candidates_scan(STensor&& smem_buffer, SyncFn const& sync_fn, int epi_m, int epi_n,
                                                   VTensor const& visit_results) {
      auto&& problem_mn = arg<kProblemMN>();
      auto&& tile_coord_mnkl = arg<kTileCoordMNKL>();
      auto&& epi_tile = arg<kEpiTile>();
      auto&& tiled_copy = arg<kTiledCopy>();
      auto&& thread_idx = arg<kThreadIdx>();
      constexpr int C = kTopCandidatesPerTile;
      constexpr int kScanners = NumThreads / EpiTileN;  // threads per column
      constexpr int kRun = EpiTileM / kScanners;        // rows each scans per subtile
      static_assert(NumThreads % EpiTileN == 0 && kScanners <= 32 && (kScanners & (kScanners - 1)) == 0 &&
                        EpiTileM % kScanners == 0 && kRun % 4 == 0,
                    "the scan assigns a power-of-two number of neighbouring lanes to each column");
      static_assert(EpiTileM * EpiTileN * sizeof(float) <=
                        decltype(cosize(smem_buffer.layout()))::value *
                            sizeof(typename remove_cvref_t<STensor>::value_type),
                    "epilogue smem buffer too small for a subtile of fp32 values");
      float* smem = reinterpret_cast<float*>(raw_pointer_cast(smem_buffer.data()));
      Tensor sTile = make_tensor(make_smem_ptr(smem), make_layout(make_shape(Int<EpiTileM>{}, Int<EpiTileN>{})));
      Tensor tCsTile = sm90_partition_for_epilogue<ReferenceSrc>(sTile, epi_tile, tiled_copy, thread_idx);
      constexpr int FragmentSize = remove_cvref_t<decltype(visit_results(0))>::kElements;

      sync_fn();  // the previous subtile's scan is done with the buffer
      CUTLASS_PRAGMA_UNROLL
      for (int epi_v = 0; epi_v < size(visit_results); ++epi_v) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) tCsTile(epi_v * FragmentSize + i) = visit_results(epi_v)[i];
      }
      sync_fn();

      if (epi_m == 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; ++j) scan_top[j] = 0;
        scan_lse_max2 = -INFINITY;
        scan_lse_sum = 0.0f;
      }
      int const column = thread_idx / kScanners;
      int const run = thread_idx % kScanners;
      auto [m_tile, n_tile, k_tile, l_tile] = tile_coord_mnkl;
      int const num_cols = get<1>(problem_mn);
      int const col = static_cast<int>(n_tile) * size<1>(CtaTileShapeMNK{}) + epi_n * EpiTileN + column;
      bool const tile_in_problem = static_cast<int>(m_tile) * size<0>(CtaTileShapeMNK{}) < get<0>(problem_mn);
      uint32_t const first_local = static_cast<uint32_t>(m_tile) * size<0>(CtaTileShapeMNK{}) +
                                   static_cast<uint32_t>(epi_m * EpiTileM + run * kRun);
      uint32_t const first_index = params.vocab_start + first_local;
      float4 const* values = reinterpret_cast<float4 const*>(smem + column * EpiTileM + run * kRun);
      // The fused truncation's fallback: the column's x stored as they are (the row's stride
      // covers whole tiles, so the tail past V needs no bound) where a later kernel may read them,
      // and y's log-mass.
      bool const store_row = params.ptr_row_logits != nullptr && tile_in_problem && col < params.batch_size;
      float4* stored = store_row && scan_stores_row_logits(params.ptr_row_top_ks, static_cast<uint32_t>(col))
                           ? reinterpret_cast<float4*>(params.ptr_row_logits +
                                                       int64_t{col} * params.row_logits_stride + first_local)
                           : nullptr;
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kRun / 4; ++q) {
        float4 const v4 = values[q];
        float const v[4] = {v4.x, v4.y, v4.z, v4.w};
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < 4; ++u) {
          insert_top_candidate(scan_top, top_scan_key(v[u], first_index + 4 * q + u));
        }
      }
      if (store_row) {
        store_run_and_add_mass<kRun>(values, stored, log2_scale_of_row(static_cast<uint32_t>(col)));
      }
      if (params.ptr_tile_winners != nullptr) {
        scan_tile_winners(smem, epi_m, epi_n, tile_in_problem);
      }
      if (epi_m != EpiM - 1) {
        return;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int delta = kScanners / 2; delta > 0; delta /= 2) {
        PackedCandidate other[C];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; ++j) other[j] = __shfl_xor_sync(0xFFFFFFFF, scan_top[j], delta);
        merge_top_candidates(scan_top, other);
        if (params.ptr_row_logits != nullptr) {
          float const other_max2 = __shfl_xor_sync(0xFFFFFFFF, scan_lse_max2, delta);
          float const other_sum = __shfl_xor_sync(0xFFFFFFFF, scan_lse_sum, delta);
          lse_merge(scan_lse_max2, scan_lse_sum, other_max2, other_sum);
        }
      }
      if (run == 0 && tile_in_problem && col < num_cols) {
        int64_t const slot = static_cast<int64_t>(m_tile) * num_cols + col;
        PackedCandidate* out = params.ptr_candidates + slot * C;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; ++j) out[j] = scan_top[j];
        if (store_row) params.ptr_lse_parts[slot] = make_float2(scan_lse_max2, scan_lse_sum);
      }
    }

    // The tile winners (ptr_tile_winners), every subtile, from the values the scan reads: plain
    // sampling's noise and argmax, a thread per (quad of columns, rows lane, lane + kQuadLanes, ...)
    // so that one Philox block serves the quad's four batch rows as in plain sampling. Each thread
    // keeps its quad's four bests over the strip; after the strip's last subtile the kQuadLanes
    // threads of a quad (neighbouring lanes) merge them and the first writes the tile's winners.
    // Greedy rows take x, excluded elements (masked, past the problem) nothing, NaN scores never
    // win: the best candidate by fs_candidate_better, as every other pass picks it.
    CUTLASS_DEVICE void scan_tile_winners(float const* smem, int epi_m, int epi_n, bool tile_in_problem) {
      constexpr int kQuads = EpiTileN / 4;
      constexpr int kQuadLanes = NumThreads / kQuads;
      static_assert(EpiTileN % 4 == 0 && NumThreads % kQuads == 0 && kQuadLanes <= 32 &&
                        (kQuadLanes & (kQuadLanes - 1)) == 0 && EpiTileM % kQuadLanes == 0,
                    "the tile winners give each quad of columns a power-of-two number of neighbouring lanes");
      auto [m_tile, n_tile, k_tile, l_tile] = arg<kTileCoordMNKL>();
      int const thread_idx = arg<kThreadIdx>();
      int const quad = thread_idx / kQuadLanes, lane = thread_idx % kQuadLanes;
      if (epi_m == 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          winner_score[j] = -INFINITY;
          winner_index[j] = kNoCandidate;
        }
      }
      // The quad's first column (a multiple of 4: its batch row is stream 4q of the Philox block).
      uint32_t const col0 =
          static_cast<uint32_t>(n_tile) * size<1>(CtaTileShapeMNK{}) + static_cast<uint32_t>(epi_n * EpiTileN + 4 * quad);
      uint32_t const last_row = params.batch_size - 1;
      float inv_t[4];
      bool any_noise = false;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) {
        // Columns past the batch (padding) read the last row's; their winners are never read.
        inv_t[j] = row_inv_temperature(params.controls, min(col0 + j, last_row),
                                       params.greedy ? 0.0f : params.inv_temperature);
        any_noise = any_noise || inv_t[j] != 0.0f;
      }
      uint32_t const first_index = params.vocab_start + static_cast<uint32_t>(m_tile) * size<0>(CtaTileShapeMNK{}) +
                                   static_cast<uint32_t>(epi_m * EpiTileM);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < EpiTileM / kQuadLanes; ++i) {
        int const r = lane + i * kQuadLanes;
        float x[4];
        bool kept[4], any_kept = false;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          x[j] = smem[(4 * quad + j) * EpiTileM + r];
          kept[j] = __float_as_uint(x[j]) != kExcludedBits;
          any_kept = any_kept || kept[j];
        }
        if (!any_kept) {
          continue;
        }
        uint32_t const index = first_index + static_cast<uint32_t>(r);
        float4 const g = any_noise ? quad_noise_x4_out_of_line(seed, offset, index, col0 >> 2)
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float const gumbel[4] = {g.x, g.y, g.z, g.w};
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          float const score = inv_t[j] == 0.0f ? x[j] : fs_perturbed_score(x[j], inv_t[j], gumbel[j]);
          if (kept[j] && fs_candidate_better(score, static_cast<int32_t>(index), winner_score[j], winner_index[j])) {
            winner_score[j] = score;
            winner_index[j] = static_cast<int32_t>(index);
          }
        }
      }
      if (epi_m != EpiM - 1) {
        return;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int delta = kQuadLanes / 2; delta > 0; delta /= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          float const other_score = __shfl_xor_sync(0xFFFFFFFF, winner_score[j], delta);
          int32_t const other_index = __shfl_xor_sync(0xFFFFFFFF, winner_index[j], delta);
          if (fs_candidate_better(other_score, other_index, winner_score[j], winner_index[j])) {
            winner_score[j] = other_score;
            winner_index[j] = other_index;
          }
        }
      }
      int const num_cols = get<1>(arg<kProblemMN>());
      if (lane == 0 && tile_in_problem) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          if (static_cast<int>(col0) + j < num_cols) {
            params.ptr_tile_winners[static_cast<int64_t>(m_tile) * num_cols + col0 + j] =
                winner_index[j] == kNoCandidate ? PackedCandidate{0} : pack_candidate(winner_score[j], winner_index[j]);
          }
        }
      }
    }

    // The fused truncation's part of the scan, out of the scan's loop (the host-int top-k pass
    // runs without it): the thread's run of x to the stored row as they are (null `stored`: a
    // row no later kernel reads), and their mass of y into the thread's log-sum-exp
    // (add_top_scan_run_mass, which the epilogue-warpgroup kernel's scan runs too).
    template <int kRunValues>
    CUTLASS_DEVICE void store_run_and_add_mass(float4 const* values, float4* stored, float y2_scale) {
      float run[kRunValues];
      uint64_t const keep_in_l2 = l2_evict_last_policy();
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kRunValues / 4; ++q) {
        float4 const v4 = values[q];
        if (stored != nullptr) store_with_l2_policy(stored + q, v4, keep_in_l2);
        run[4 * q] = v4.x;
        run[4 * q + 1] = v4.y;
        run[4 * q + 2] = v4.z;
        run[4 * q + 3] = v4.w;
      }
      add_top_scan_run_mass<kRunValues>(run, y2_scale, scan_lse_max2, scan_lse_sum);
    }

    // The factor from x to the log-masses' values in log2 units (candidate_math.cuh).
    CUTLASS_DEVICE float log2_scale_of_row(uint32_t row) const {
      return top_scan_log2_scale(params.controls, row, params.inv_temperature);
    }

    // The top-k pass's reduce: the same three stages as the argmax (lanes sharing a column by
    // shuffles, warps stacked in M through shared memory, then one thread per column), each
    // merging descending lists of kTopCandidatesPerTile keys; writes them to
    // ptr_candidates[(m_tile * num_cols + col) * kTopCandidatesPerTile + j].
    template <class STensor, class SyncFn, class MTile>
    CUTLASS_DEVICE void reduce_top_candidates(STensor&& smem_buffer, SyncFn const& sync_fn, int col_base, int num_cols,
                                              MTile m_tile) {
      auto&& tCrTop = arg<kTop>();
      auto&& problem_mn = arg<kProblemMN>();
      auto&& lane_layout_MN = arg<kLaneLayoutMN>();
      auto&& lane_mn = arg<kLaneMN>();
      auto&& warp_mn = arg<kWarpMN>();
      auto&& epi_tile = arg<kEpiTile>();
      auto&& tiled_copy = arg<kTiledCopy>();
      auto&& thread_idx = arg<kThreadIdx>();
      constexpr int C = kTopCandidatesPerTile;
      auto sBuf_layout = make_layout(make_shape(Int<EpiTileM>{}, Int<EpiTileN>{}, Int<WarpsM>{}),
                                     make_stride(_0{}, _1{}, Int<EpiTileN>{}));
      constexpr int kEntries = EpiTileN * WarpsM;
      static_assert(kEntries * C * sizeof(PackedCandidate) <=
                        decltype(cosize(smem_buffer.layout()))::value *
                            sizeof(typename remove_cvref_t<STensor>::value_type),
                    "epilogue smem buffer too small for the top-k candidate reduction");
      PackedCandidate* smem = reinterpret_cast<PackedCandidate*>(raw_pointer_cast(smem_buffer.data()));

      // 1. This thread's distinct columns, merged over the lanes that share them.
      Tensor tCrTop_flt = filter(tCrTop(_, 0));
      constexpr int NumCols = decltype(size(tCrTop_flt))::value;
      PackedCandidate top[NumCols][C];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < C; ++j) {
        Tensor tCrTop_j = filter(tCrTop(_, j));
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NumCols; ++i) top[i][j] = tCrTop_j(i);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int rows = size<0>(lane_layout_MN) / 2; rows > 0; rows /= 2) {
        int const lane_delta = lane_layout_MN(rows, _0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NumCols; ++i) {
          PackedCandidate other[C];
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < C; ++j) other[j] = __shfl_down_sync(0xFFFFFFFF, top[i][j], lane_delta);
          merge_top_candidates(top[i], other);
        }
      }

      // 2. Lanes at M position 0 stage their warp's lists in shared memory, list j at j * kEntries.
      sync_fn();
      if (get<0>(lane_mn) == 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; ++j) {
          Tensor sTop_j = make_tensor(make_smem_ptr(smem + j * kEntries), sBuf_layout);
          Tensor tCsTop_j = filter(
              sm90_partition_for_epilogue<ReferenceSrc>(sTop_j(_, _, get<0>(warp_mn)), epi_tile, tiled_copy, thread_idx));
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < NumCols; ++i) tCsTop_j(i) = top[i][j];
        }
      }
      sync_fn();

      // 3. One thread per column merges the warps' lists and writes them.
      bool const tile_in_problem = static_cast<int>(m_tile) * size<0>(CtaTileShapeMNK{}) < get<0>(problem_mn);
      for (int col = thread_idx; tile_in_problem && col < EpiTileN; col += size(tiled_copy)) {
        if (col_base + col >= num_cols) {
          continue;
        }
        PackedCandidate best[C];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; ++j) best[j] = smem[j * kEntries + col];
        CUTLASS_PRAGMA_UNROLL
        for (int w = 1; w < WarpsM; ++w) {
          PackedCandidate other[C];
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < C; ++j) other[j] = smem[j * kEntries + w * EpiTileN + col];
          merge_top_candidates(best, other);
        }
        PackedCandidate* out =
            params.ptr_candidates + (static_cast<int64_t>(m_tile) * num_cols + col_base + col) * C;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; ++j) out[j] = best[j];
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const& args) {
    // Which lanes and warps of the epilogue share a column: tile (m, n) -> thread/value index,
    // then thread -> lane / warp, restricted to each mode.
    Layout ref_layout_MN = [&]() {
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) {
        return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      } else {
        return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
      }
    }();
    using NumWarps = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, NumWarps, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    auto lane_mn = idx2crd(right_inverse(lane_layout_MN)(cutlass::canonical_lane_idx()), shape(lane_layout_MN));

    Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, NumWarps, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    auto warp_mn = idx2crd(right_inverse(warp_layout_MN)(args.thread_idx / cutlass::NumThreadsPerWarp), shape(warp_layout_MN));

    // Per-thread state for the columns of one epilogue strip: a (CTA_M, CTA_N) layout
    // with stride 0 over M, partitioned like the accumulators.
    auto [M, N, K, L] = args.problem_shape_mnkl;
    Layout col_layout = make_layout(take<0, 2>(args.tile_shape_mnk), Stride<_0, _1>{});
    Tensor tCcol = sm90_partition_for_epilogue<ReferenceSrc>(make_tensor(make_gmem_ptr<float>(nullptr), col_layout),
                                                             args.epi_tile, args.tiled_copy, args.thread_idx);
    // Compact, keeping the stride-0 modes over M.
    auto strip_layout = make_layout_like(tCcol(_, _, _, _0{}, _0{}).layout());  // (CPY, CPY_M, CPY_N)
    Tensor tCrScore = make_tensor<float>(strip_layout);
    Tensor tCrIndex = make_tensor<int32_t>(strip_layout);
    Tensor tCrLogit = make_tensor<float>(strip_layout);
    Tensor tCrLseMax = make_tensor<float>(strip_layout);
    Tensor tCrLseSum = make_tensor<float>(strip_layout);
    // The top-k pass's lists: kTopCandidatesPerTile keys per strip slot (one key otherwise, unused).
    constexpr int kTopSlots = kLoop == SamplerLoop::kTopCandidates && !kTopScan ? kTopCandidatesPerTile : 1;
    Tensor tCrTop = make_tensor<PackedCandidate>(
        make_layout(strip_layout, make_layout(Int<kTopSlots>{}, Int<decltype(cosize(strip_layout))::value>{})));

    // In StoreArg's order.
    auto args_tuple = make_tuple(bool_constant<ReferenceSrc>{}, cute::move(tCrScore), cute::move(tCrIndex),
                                 cute::move(tCrLogit), cute::move(tCrLseMax), cute::move(tCrLseSum), args.tCcD,
                                 args.residue_tCcD, make_coord(int(M), int(N)), lane_layout_MN, lane_mn,
                                 warp_layout_MN, warp_mn, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy,
                                 args.thread_idx, cute::move(tCrTop));
    static_assert(std::tuple_size<decltype(args_tuple)>::value == kNumStoreArgs, "one StoreArg per field");
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

}  // namespace flashsampling::epilogue
