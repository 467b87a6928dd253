// CUDA implementation of flashsampling::sample: argument checks, device guard,
// stream, workspace, seed/offset resolution (graph-safe), architecture dispatch.
// The kernels themselves (csrc/kernels/) never see torch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <mutex>
#include <optional>
#include <vector>

#include "checks.h"
#include "cuda_device_info.h"
#include "cuda_launch_check.h"
#include "flashsampling/philox_gumbel.h"
#include "flashsampling/row_truncation_launch.h"
#include "flashsampling/sample_from_logits.h"
#include "flashsampling/sampler_params.h"
#include "flashsampling/top_logprobs.h"

namespace flashsampling {
namespace {

// A 0-d int64 tensor becomes a value (CPU) or a device pointer the kernel reads at
// run time (CUDA: no sync, and a captured graph sees the value at replay).
// check_sample_args has already required it to be on the CPU or on hidden's device.
void take_scalar_tensor(const at::Tensor& t, uint64_t& value, const int64_t*& device_ptr) {
  if (t.is_cuda()) {
    device_ptr = t.data_ptr<int64_t>();
  } else {
    value = static_cast<uint64_t>(t.item<int64_t>());
  }
}

// The batch-wide seed/offset, or per-row [B] arrays on the device (stream 0 with
// per-row seeds), and the per-row streams where given. `keep_alive` holds the device copies of
// host-resident [B] tensors.
NoiseSource resolve_noise(const at::Tensor& hidden, int64_t num_samples, const std::optional<at::Tensor>& seed,
                          const std::optional<at::Tensor>& offset, const std::optional<at::Generator>& generator,
                          const std::optional<at::Tensor>& streams, std::vector<at::Tensor>& keep_alive) {
  NoiseSource src;
  auto per_row_on_device = [&](const at::Tensor& t) {
    at::Tensor d = t.to(hidden.device(), /*non_blocking=*/false).contiguous();
    keep_alive.push_back(d);
    return d.const_data_ptr<int64_t>();
  };
  if (streams.has_value()) src.row_streams = per_row_on_device(*streams);
  if (seed.has_value()) {
    if (seed->dim() == 1) {
      src.row_seeds = per_row_on_device(*seed);
    } else {
      take_scalar_tensor(*seed, src.seed, src.seed_device);
    }
    if (offset.has_value()) {
      if (offset->dim() == 1) {
        src.row_offsets = per_row_on_device(*offset);
      } else {
        take_scalar_tensor(*offset, src.offset, src.offset_device);
      }
    }
    return src;
  }
  // Torch's own Philox convention: under graph capture the generator hands out
  // device pointers plus an intra-graph offset, so every replay draws fresh noise.
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      generator, at::cuda::detail::getDefaultCUDAGenerator(hidden.get_device()));
  // Sample s uses offset + s: reserve num_samples offsets (torch wants multiples of 4).
  const uint64_t increment = static_cast<uint64_t>((num_samples + 3) / 4 * 4);
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(increment);
  }
  if (state.captured_) {
    src.seed_device = state.seed_.ptr;
    src.offset_device = state.offset_.ptr;
    src.offset_device_add = state.offset_intragraph_;
  } else {
    src.seed = state.seed_.val;
    src.offset = state.offset_.val;
  }
  return src;
}

void check_tma_operand(const at::Tensor& t, const char* name) {
  const int64_t elem = t.element_size();
  TORCH_CHECK(t.stride(1) == 1, "flashsampling.sample: ", name,
              " must have unit stride along D on CUDA (got strides ", t.strides(), "); call .contiguous()");
  TORCH_CHECK((t.stride(0) * elem) % 16 == 0 || t.size(0) == 1, "flashsampling.sample: ", name,
              " row stride must be a multiple of 16 bytes on CUDA (got ", t.stride(0), " elements)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flashsampling.sample: ", name,
              " must be 16-byte aligned on CUDA (TMA); got a view at a misaligned offset, call .clone()");
}

bool current_stream_capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

// An optional device tensor's data for a kernel's params: nullptr when absent, else its
// contiguous copy's (or itself), which `keep_alive` holds until the launch is enqueued.
template <class T>
const T* kept_data(const std::optional<at::Tensor>& t, std::vector<at::Tensor>& keep_alive) {
  if (!t.has_value()) return nullptr;
  keep_alive.push_back(t->contiguous());
  return static_cast<const T*>(keep_alive.back().const_data_ptr());
}

// The per-row truncation arrays of sample_top_k and sample_from_logits: int32 or int64 top_ks and
// float32 or float64 top_ps / min_ps, each [B] on the device of `rows` ([B, ...], named `rows_name`).
void check_per_row_truncation(const char* prefix, const at::Tensor& rows, const char* rows_name,
                              const std::optional<at::Tensor>& top_ks, const std::optional<at::Tensor>& top_ps,
                              const std::optional<at::Tensor>& min_ps) {
  const int64_t batch = rows.size(0);
  for (auto [name, t, integer] : {std::tuple{"top_ks", &top_ks, true}, std::tuple{"top_ps", &top_ps, false},
                                  std::tuple{"min_ps", &min_ps, false}}) {
    if (!t->has_value()) continue;
    const at::Tensor& v = **t;
    const at::ScalarType type = v.scalar_type();
    const bool allowed = integer ? (type == at::kInt || type == at::kLong) : (type == at::kFloat || type == at::kDouble);
    TORCH_CHECK(allowed, prefix, name, " must be ", integer ? "an int32 or int64" : "a float32 or float64",
                " tensor, got ", type);
    TORCH_CHECK(v.dim() == 1 && v.size(0) == batch, prefix, name, " must have shape [B] = [", batch, "], got ",
                v.sizes());
    TORCH_CHECK(v.device() == rows.device(), prefix, name, " must be on ", rows_name, " device (", rows.device(),
                "), got ", v.device());
  }
}

// The per-row truncation arrays in the kernels' types (int64 top_ks, float64 top_ps / min_ps): a
// wide array as it is, a narrow one (int32 / float32) widened into a new one by
// launch_widen_row_truncation, which the caller runs once with every array (and the fallback row
// list's count) on the stream before the kernels that read them.
struct RowTruncationArrays {
  const int64_t* top_ks = nullptr;
  const double* top_ps = nullptr;
  const double* min_ps = nullptr;
  RowTruncationWidening widening;
};
RowTruncationArrays row_truncation_arrays(const std::optional<at::Tensor>& top_ks,
                                          const std::optional<at::Tensor>& top_ps,
                                          const std::optional<at::Tensor>& min_ps, int64_t batch,
                                          std::vector<at::Tensor>& keep_alive) {
  RowTruncationArrays a;
  a.widening.batch_size = batch;
  auto array = [&](const std::optional<at::Tensor>& t, at::ScalarType wide, RowTruncationArray& w) -> const void* {
    if (!t.has_value()) return nullptr;
    const at::Tensor from = t->contiguous();
    keep_alive.push_back(from);
    if (from.scalar_type() == wide) return from.const_data_ptr();
    const at::Tensor to = at::empty({batch}, from.options().dtype(wide));
    keep_alive.push_back(to);
    w = {from.const_data_ptr(), to.data_ptr()};
    return to.const_data_ptr();
  };
  a.top_ks = static_cast<const int64_t*>(array(top_ks, at::kLong, a.widening.top_ks));
  a.top_ps = static_cast<const double*>(array(top_ps, at::kDouble, a.widening.top_ps));
  a.min_ps = static_cast<const double*>(array(min_ps, at::kDouble, a.widening.min_ps));
  return a;
}

// The fused top-k arguments of flashsampling::sample_top_k (ops.cpp).
struct FusedTopK {
  int64_t top_k = 0;
  std::optional<double> top_p, min_p;
  std::optional<at::Tensor> top_ps, min_ps, top_ks;
};

void check_fused_top_k(const at::Tensor& hidden, const SampleArgs& args, const FusedTopK& top) {
  const char* prefix = "flashsampling.sample_top_k: ";
  TORCH_CHECK(top.top_k >= -1, prefix, "top_k must be an integer >= -1 (-1 or 0: off), got ", top.top_k);
  TORCH_CHECK(!args.sparse_bias_ids.has_value() || args.sparse_bias_ids->size(1) == 0, prefix,
              "sparse_bias_ids is not supported by the fused top-k path (flashsampling_cuda.sample routes it to the "
              "materialised one)");
  TORCH_CHECK(!top.top_p.has_value() || (*top.top_p > 0.0 && *top.top_p <= 1.0), prefix,
              "top_p must be in (0, 1], got ", top.top_p.value_or(0.0));
  TORCH_CHECK(!top.min_p.has_value() || (*top.min_p >= 0.0 && *top.min_p <= 1.0), prefix,
              "min_p must be in [0, 1], got ", top.min_p.value_or(0.0));
  check_per_row_truncation(prefix, hidden, "hidden's", top.top_ks, top.top_ps, top.min_ps);
}

// The top-N kernels over the rows stage 2 left (TopLogprobRows::row_modes), from the GEMM's
// stored logits, the log-sum-exp (processed: the sampler's; raw: stage 2's) and the tokens (after
// the logits sampler's rows).
// Raw mode (TopLogprobRows::raw_logsumexp): the raw values of x with the raw log-sum-exp, and the
// sampled tokens' raw log-probabilities from the rank pass.
void launch_top_logprob_leftovers(const SamplerParams& p, const SampleResult& result, int sm_count) {
  const bool raw = p.top_logprobs.raw_logsumexp != nullptr;
  TopLogprobsParams t;
  t.values = p.row_logits;
  t.row_stride = p.row_logits_stride;
  t.batch_size = p.batch_size;
  t.vocab_size = p.vocab_size;
  t.lse_float = raw ? p.top_logprobs.raw_logsumexp : p.logsumexp;
  t.scales = raw ? nullptr : p.top_logprobs.row_scales;
  t.raw = raw;
  t.token_values = raw ? p.token_logprobs : nullptr;
  t.tokens = p.tokens;
  t.token_base = p.vocab_start;
  t.num_samples = 1;
  t.top_n = p.top_logprobs.top_n;
  t.row_modes = p.top_logprobs.row_modes;
  t.top_values = result.top_values.data_ptr<float>();
  t.top_ids = result.top_ids.data_ptr<int64_t>();
  t.ranks = result.ranks.data_ptr<int64_t>();
  const at::Tensor workspace = at::empty({static_cast<int64_t>(top_logprobs_workspace_bytes(p.batch_size, 1))},
                                         result.tokens.options().dtype(at::kByte));
  const cudaError_t err = launch_top_logprobs(t, workspace.data_ptr(), sm_count, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flashsampling._sample_top_logprobs: CUDA kernel launch failed: ",
              cudaGetErrorString(err));
}

// `position_rows`: the flashsampling._sample_positions layout, `gemm_hidden` [S * B, D] holding
// a row per (sample, batch row), sample-major, in place of the batch S times; the batch is its
// first B rows (every check and the noise's [B] arrays take their shape from those).
// `top_n` >= 0 (with `top` nothing on): flashsampling._sample_top_logprobs's outputs as well, of
// the raw logits where `raw_top_logprobs` (no bias: x is the matmul).
SampleResult sample_cuda_impl(const at::Tensor& gemm_rows, const at::Tensor& weight, const SampleArgs& args,
                              const FusedTopK* top, bool position_rows = false, int64_t top_n = -1,
                              bool raw_top_logprobs = false) {
  const at::Tensor hidden = position_rows ? gemm_rows.narrow(0, 0, gemm_rows.size(0) / args.num_samples) : gemm_rows;
  check_sample_args(hidden, weight, args);
  if (top != nullptr) check_fused_top_k(hidden, args, *top);
  c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t batch = hidden.size(0);
  const int64_t dim = hidden.size(1);
  const int64_t vocab = weight.size(0);
  const int64_t num_samples = args.num_samples;

  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kHalf,
              "flashsampling.sample: the CUDA kernel takes bfloat16 or float16 hidden/weight, got ",
              hidden.scalar_type(), "; cast with .to(torch.bfloat16)");
  TORCH_CHECK(dim % 8 == 0, "flashsampling.sample: the CUDA kernel needs the hidden size D to be a multiple of 8 "
              "(16-byte TMA rows), got D=", dim, "; zero-pad hidden and weight along D (exact: padded products are 0)");
  // The reduction kernel puts samples on gridDim.y.
  TORCH_CHECK(num_samples <= 65535, "flashsampling.sample: num_samples must be <= 65535 on CUDA, got ",
              num_samples);
  // Samples are GEMM columns: B * num_samples of them must fit the kernel's int extents.
  TORCH_CHECK(batch * num_samples <= INT32_MAX, "flashsampling.sample: batch size times num_samples (", batch, " x ",
              num_samples, ") must be < 2^31 on CUDA");

  const auto float_options = hidden.options().dtype(at::kFloat);
  SampleResult result;
  result.tokens = at::empty({batch, num_samples}, hidden.options().dtype(at::kLong));
  result.scores = at::empty({batch, num_samples}, float_options);
  // Shapes as the fake kernel (flashsampling_cuda/sampling.py) states them.
  result.token_logprobs =
      args.return_logprobs ? at::empty({batch, num_samples}, float_options) : at::empty({0}, float_options);
  result.logsumexp = args.return_logprobs ? at::empty({batch}, float_options) : at::empty({0}, float_options);
  if (batch == 0) {
    return result;
  }
  check_tma_operand(weight, "weight");
  check_tma_operand(gemm_rows, "hidden");
  check_mask_rows_nonempty(weight, args, current_stream_capturing());

  const DeviceInfo device = device_info(hidden.get_device());
  const int arch = device.arch;
  TORCH_CHECK_NOT_IMPLEMENTED(arch == 90 || arch == 100, "flashsampling.sample: no fused kernel for sm_", arch,
                              " (this build has ", sampler_compiled_archs(),
                              "); supported GPUs: Hopper sm_90 (H100/H200) and Blackwell sm_100 (B200/GB200)");

  std::vector<at::Tensor> keep_alive;  // device copies the kernels read; freed after the launch (stream-ordered)
  // S samples = S copies of the batch as GEMM columns (sample-major); the copy is
  // S * B * D elements, tiny next to W.
  // (The fused top-k pass draws its samples in stage 2: one column per row.)
  const at::Tensor gemm_hidden =
      num_samples == 1 || top != nullptr || position_rows ? gemm_rows : hidden.repeat({num_samples, 1});
  keep_alive.push_back(gemm_hidden);
  SamplerParams p;
  p.weight = weight.data_ptr();
  p.hidden = gemm_hidden.data_ptr();
  p.vocab_size = vocab;
  p.hidden_dim = dim;
  p.batch_size = batch;
  // A single row's stride is meaningless (and may be anything); TMA wants a valid one.
  p.weight_row_stride = vocab == 1 ? dim : weight.stride(0);
  p.hidden_row_stride = gemm_hidden.size(0) == 1 ? dim : gemm_hidden.stride(0);
  p.element_type = hidden.scalar_type() == at::kBFloat16 ? ElementType::kBFloat16 : ElementType::kFloat16;
  p.vocab_start = args.vocab_start;
  p.inv_temperature = fs_inv_temperature(static_cast<float>(args.temperature));
  // A per-row temperatures tensor wins over the scalar (as on the CPU): greedy only without one.
  p.greedy = p.inv_temperature == 0.0f && !args.temperatures.has_value();

  SamplingControls& c = p.controls;
  c.mask_words = (vocab + 31) / 32;
  const ModelTransform model = model_transform(args.logit_scale, args.logit_softcap);
  c.logit_scale = model.scale;
  c.logit_softcap = model.softcap;
  c.inv_logit_softcap = model.inv_softcap;
  c.temperatures = kept_data<float>(args.temperatures, keep_alive);
  c.logit_bias = kept_data<float>(args.logit_bias, keep_alive);
  c.allowed_mask = kept_data<uint32_t>(args.allowed_mask, keep_alive);  // int32 words, read as uint32
  if (args.sparse_bias_ids.has_value() && args.sparse_bias_ids->size(1) > 0) {
    TORCH_CHECK(args.sparse_bias_ids->size(1) <= INT32_MAX, "flashsampling.sample: sparse_bias_ids has too many columns");
    // int32 ids for the kernel; ids outside [0, 2^31 - 1) can match no token, so clamp
    // them to values that match none (-1 or INT32_MAX, above any vocab index).
    const at::Tensor ids = args.sparse_bias_ids->clamp(-1, INT32_MAX).to(at::kInt).contiguous();
    const at::Tensor values = args.sparse_bias_values->contiguous();
    keep_alive.push_back(ids);
    keep_alive.push_back(values);
    c.sparse_ids = ids.const_data_ptr<int32_t>();
    c.sparse_values = values.const_data_ptr<float>();
    c.sparse_k = static_cast<int>(ids.size(1));
  }

  if (args.penalty_ids.has_value()) {
    // launch_sampler builds the rank bitmap of these before the GEMM (graph-safe: shapes only).
    const at::Tensor ids = args.penalty_ids->contiguous();
    keep_alive.push_back(ids);
    c.penalty_ids = ids.const_data_ptr<int64_t>();
    c.penalty_capacity = static_cast<int>(ids.size(1));
    c.penalty_values = kept_data<float>(args.penalty_values, keep_alive);
    c.repetition_penalties = kept_data<float>(args.repetition_penalties, keep_alive);
  }

  p.noise = resolve_noise(hidden, num_samples, args.seed, args.offset, args.generator, args.streams, keep_alive);
  p.num_samples = static_cast<int>(num_samples);
  p.tokens = result.tokens.data_ptr<int64_t>();
  p.scores = result.scores.data_ptr<float>();
  p.logprobs = args.return_logprobs;
  if (p.logprobs) {
    p.token_logprobs = result.token_logprobs.data_ptr<float>();
    p.logsumexp = result.logsumexp.data_ptr<float>();
  }
  p.empty_mask_token = args.empty_mask_token.value_or(-1);
  RowTruncationArrays row_truncation;
  if (top != nullptr) {
    p.fused_truncation = true;
    p.top_k = top->top_k;
    p.top_p = top->top_p.value_or(1.0);
    p.min_p = top->min_p.value_or(0.0);
    row_truncation = row_truncation_arrays(top->top_ks, top->top_ps, top->min_ps, batch, keep_alive);
    p.top_ps = row_truncation.top_ps;
    p.min_ps = row_truncation.min_ps;
    p.top_ks = row_truncation.top_ks;
    if (!fused_truncation_decides_every_row(p)) {
      // The logits of the rows stage 2 leaves come from this GEMM pass (sm90: its top-k scan
      // stores them; flashsampling_cuda.sample takes the logits path elsewhere).
      TORCH_CHECK_NOT_IMPLEMENTED(arch == 90, "flashsampling.sample_top_k: per-row top_k tensors, top_k outside [1, ",
                                  kMaxFusedTopK, "] and top_p / min_p without top_k need sm_90 on the fused path (this "
                                  "GPU is sm_", arch, "); flashsampling_cuda.sample takes the logits path there");
      const int64_t stride = (vocab + 127) / 128 * 128;
      // A large host top_k on the epilogue-warpgroup scan stores its runs' keys in the workspace instead
      // (top_n is asked here: p.top_logprobs is filled in below, and a top-N call returns these logits).
      const at::Tensor row_logits =
          top_n < 0 && sampler_stores_run_keys(p, arch) ? at::Tensor() : at::empty({batch, stride}, float_options);
      if (row_logits.defined()) {
        keep_alive.push_back(row_logits);
        p.row_logits = row_logits.data_ptr<float>();
        p.row_logits_stride = stride;
      }
      if (!fused_truncation_selects_large_top_k(p)) {  // which decides every row itself
        // Its count is zeroed with the widening, below.
        const at::Tensor fallback_rows = at::empty({batch + 1}, hidden.options().dtype(at::kInt));
        keep_alive.push_back(fallback_rows);
        p.fallback_rows = fallback_rows.data_ptr<int32_t>();
        row_truncation.widening.list_count = p.fallback_rows;
      }
      if (top_n >= 0) {
        result.top_values = at::empty({batch, top_n}, float_options);
        result.top_ids = at::empty({batch, top_n}, hidden.options().dtype(at::kLong));
        result.ranks = at::empty({batch, 1}, hidden.options().dtype(at::kLong));
        result.logits = row_logits.narrow(1, 0, vocab);
        const at::Tensor row_modes = at::empty({batch}, hidden.options().dtype(at::kByte));
        const at::Tensor row_scales = at::empty({batch}, float_options);
        keep_alive.push_back(row_modes);
        keep_alive.push_back(row_scales);
        TopLogprobRows& rows = p.top_logprobs;
        rows.top_n = static_cast<int>(top_n);
        rows.values = result.top_values.data_ptr<float>();
        rows.ids = result.top_ids.data_ptr<int64_t>();
        rows.ranks = result.ranks.data_ptr<int64_t>();
        rows.row_modes = row_modes.data_ptr<uint8_t>();
        rows.row_scales = row_scales.data_ptr<float>();
        if (raw_top_logprobs) {  // the call returns the raw log-sum-exp; the sampler's goes to scratch
          const at::Tensor processed_logsumexp = at::empty({batch}, float_options);
          keep_alive.push_back(processed_logsumexp);
          rows.raw_logsumexp = result.logsumexp.data_ptr<float>();
          p.logsumexp = processed_logsumexp.data_ptr<float>();
          p.controls.top_scan_masses_of_x = true;
        }
      }
    }
  }
  p.device_sm_count = device.sm_count;

  const size_t workspace_bytes = sampler_workspace_bytes(p, arch);
  TORCH_CHECK_NOT_IMPLEMENTED(workspace_bytes > 0, "flashsampling.sample: this build has no kernel for sm_", arch,
                              " and ", hidden.scalar_type(), " (compiled: ", sampler_compiled_archs(),
                              "); rebuild with FLASHSAMPLING_CUDA_ARCHS / FLASHSAMPLING_ELEMENT_TYPES");
  if (top != nullptr) {
    TORCH_CHECK(fused_top_k_fits(p, arch), "flashsampling.sample_top_k: the vocabulary (V=", vocab,
                ") is too large for the fused top-k pass's stage 2; flashsampling_cuda.sample takes another path");
  }
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, hidden.options().dtype(at::kByte));
  check_cuda_launch(launch_widen_row_truncation(row_truncation.widening, c10::cuda::getCurrentCUDAStream()),
                    "flashsampling.sample");
  const cudaError_t err =
      launch_sampler(p, workspace.data_ptr(), workspace_bytes, arch, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flashsampling.sample: CUDA kernel launch failed: ", cudaGetErrorString(err));
  if (top_n >= 0) {
    TORCH_CHECK(result.top_values.defined(), "flashsampling._sample_top_logprobs: the fused top-k pass did not store "
                "the logits");
    launch_top_logprob_leftovers(p, result, device.sm_count);
  }
  return result;
}

SampleResult sample_cuda(const at::Tensor& hidden, const at::Tensor& weight, const SampleArgs& args) {
  return sample_cuda_impl(hidden, weight, args, nullptr);
}

// flashsampling._sample_positions (ops.cpp): S = positions samples whose GEMM columns are the
// rows of hidden [S * B, D] themselves.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sample_positions_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, int64_t positions, double temperature,
    const std::optional<at::Tensor>& temperatures, const at::Tensor& seed, const at::Tensor& offset,
    const std::optional<at::Tensor>& logit_bias, const std::optional<at::Tensor>& allowed_mask,
    std::optional<int64_t> empty_mask_token, int64_t vocab_start, double logit_scale,
    std::optional<double> logit_softcap, bool return_logprobs) {
  check_position_rows(hidden, positions);
  const SampleArgs args = SampleOps<&sample_cuda>::make_args(
      temperature, temperatures, positions, seed, offset, std::nullopt, logit_bias, std::nullopt, std::nullopt,
      allowed_mask, empty_mask_token, vocab_start, return_logprobs, logit_scale, logit_softcap);
  SampleResult r = sample_cuda_impl(hidden, weight, args, nullptr, /*position_rows=*/true);
  return {r.tokens, r.scores, r.token_logprobs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_top_k_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, double temperature,
    const std::optional<at::Tensor>& temperatures, int64_t num_samples, const std::optional<at::Tensor>& seed,
    const std::optional<at::Tensor>& offset, std::optional<at::Generator> generator,
    const std::optional<at::Tensor>& logit_bias, const std::optional<at::Tensor>& sparse_bias_ids,
    const std::optional<at::Tensor>& sparse_bias_values, const std::optional<at::Tensor>& allowed_mask,
    std::optional<int64_t> empty_mask_token, int64_t vocab_start, bool return_logprobs, int64_t top_k,
    std::optional<double> top_p, const std::optional<at::Tensor>& top_ps, std::optional<double> min_p,
    const std::optional<at::Tensor>& min_ps, const std::optional<at::Tensor>& top_ks,
    const std::optional<at::Tensor>& streams) {
  const SampleArgs args = SampleOps<&sample_cuda>::make_args(
      temperature, temperatures, num_samples, seed, offset, std::move(generator), logit_bias, sparse_bias_ids,
      sparse_bias_values, allowed_mask, empty_mask_token, vocab_start, return_logprobs, /*logit_scale=*/1.0,
      /*logit_softcap=*/std::nullopt, /*penalty_ids=*/std::nullopt, /*penalty_values=*/std::nullopt,
      /*repetition_penalties=*/std::nullopt, streams);
  const FusedTopK top{top_k, top_p, min_p, top_ps, min_ps, top_ks};
  SampleResult r = sample_cuda_impl(hidden, weight, args, &top);
  return {r.tokens, r.scores, r.token_logprobs, r.logsumexp};
}

// flashsampling._sample_top_logprobs (ops.cpp): the fused top-k pass with nothing on, its stage 2
// also giving the top-N log-probabilities and the sample's rank (SamplerParams::top_logprobs).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
sample_top_logprobs_cuda(const at::Tensor& hidden, const at::Tensor& weight, double temperature,
                         const std::optional<at::Tensor>& temperatures, int64_t num_samples,
                         const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                         std::optional<at::Generator> generator, const std::optional<at::Tensor>& logit_bias,
                         const std::optional<at::Tensor>& sparse_bias_ids,
                         const std::optional<at::Tensor>& sparse_bias_values,
                         const std::optional<at::Tensor>& allowed_mask, std::optional<int64_t> empty_mask_token,
                         int64_t vocab_start, int64_t top_n, bool raw) {
  const char* prefix = "flashsampling._sample_top_logprobs: ";
  TORCH_CHECK(top_n >= 0 && top_n <= kMaxTopLogprobs, prefix, "top_n must be in [0, ", kMaxTopLogprobs, "], got ",
              top_n);
  TORCH_CHECK(top_n <= weight.size(0), prefix, "top_n must be at most V=", weight.size(0), ", got ", top_n);
  TORCH_CHECK(num_samples == 1, prefix, "num_samples must be 1, got ", num_samples);
  TORCH_CHECK_NOT_IMPLEMENTED(device_info(hidden.get_device()).arch == 90, prefix,
                              "needs sm_90 (H100/H200); flashsampling_cuda.sample takes the logits route elsewhere");
  TORCH_CHECK(!allowed_mask.has_value() && !sparse_bias_ids.has_value(), prefix,
              "takes no allowed_mask or sparse bias (flashsampling_cuda.sample routes those calls elsewhere)");
  TORCH_CHECK(!raw || !logit_bias.has_value(), prefix,
              "raw takes no logit_bias (the logits the pass stores have it added)");
  const SampleArgs args = SampleOps<&sample_cuda>::make_args(
      temperature, temperatures, num_samples, seed, offset, std::move(generator), logit_bias, sparse_bias_ids,
      sparse_bias_values, allowed_mask, empty_mask_token, vocab_start, /*return_logprobs=*/true);
  const FusedTopK nothing_on{};
  SampleResult r = sample_cuda_impl(hidden, weight, args, &nothing_on, /*position_rows=*/false, top_n, raw);
  if (hidden.size(0) == 0) {  // the shapes and strides of a batch's (the fake kernel's)
    const int64_t vocab = weight.size(0);
    r.top_values = at::empty({0, top_n}, hidden.options().dtype(at::kFloat));
    r.top_ids = at::empty({0, top_n}, hidden.options().dtype(at::kLong));
    r.ranks = at::empty({0, 1}, hidden.options().dtype(at::kLong));
    r.logits = at::empty_strided({0, vocab}, {(vocab + 127) / 128 * 128, 1}, hidden.options().dtype(at::kFloat));
  }
  return {r.tokens, r.scores, r.token_logprobs, r.logsumexp, r.top_values, r.top_ids, r.ranks, r.logits};
}

// flashsampling::sample_from_logits's truncation arguments: host scalars, or [B] device arrays
// (int32 or int64 top_ks, float32 or float64 top_ps / min_ps) that win over them.
void check_logits_truncation(const at::Tensor& logits, double top_p, double min_p,
                             const std::optional<at::Tensor>& top_ks, const std::optional<at::Tensor>& top_ps,
                             const std::optional<at::Tensor>& min_ps) {
  const char* prefix = "flashsampling.sample_from_logits: ";
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, prefix, "top_p must be in (0, 1] (1: off), got ", top_p);
  TORCH_CHECK(min_p >= 0.0 && min_p <= 1.0, prefix, "min_p must be in [0, 1] (0: off), got ", min_p);
  check_per_row_truncation(prefix, logits, "logits'", top_ks, top_ps, min_ps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_from_logits_cuda(
    const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures,
    int64_t num_samples, const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
    std::optional<at::Generator> generator, const std::optional<at::Tensor>& logit_bias,
    const std::optional<at::Tensor>& allowed_mask, std::optional<int64_t> empty_mask_token, int64_t vocab_start,
    bool return_logprobs, int64_t top_k, const std::optional<at::Tensor>& top_ks, double top_p,
    const std::optional<at::Tensor>& top_ps, double min_p, const std::optional<at::Tensor>& min_ps) {
  TORCH_CHECK(logits.dim() == 2, "flashsampling.sample_from_logits: logits must be 2-D [B, V], got shape ",
              logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "flashsampling.sample_from_logits: logits must be float32, got ",
              logits.scalar_type());
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab <= kLogitsSamplerMaxVocab, "flashsampling.sample_from_logits: logits must have V <= ",
              kLogitsSamplerMaxVocab, " columns on CUDA, got V=", vocab);
  // The controls are checked as sample's are, against stand-ins of hidden [B, 0] and weight
  // [V, 0] on logits' device (empty: nothing is allocated), so the messages are the same.
  const auto stand_in = logits.options().dtype(at::kBFloat16);
  const at::Tensor hidden = at::empty({batch, 0}, stand_in), weight = at::empty({vocab, 0}, stand_in);
  const SampleArgs args = SampleOps<&sample_cuda>::make_args(
      temperature, temperatures, num_samples, seed, offset, std::move(generator), logit_bias, std::nullopt,
      std::nullopt, allowed_mask, empty_mask_token, vocab_start, return_logprobs);
  check_sample_args(hidden, weight, args);
  check_logits_truncation(logits, top_p, min_p, top_ks, top_ps, min_ps);
  TORCH_CHECK(logits.stride(1) == 1 || vocab == 1,
              "flashsampling.sample_from_logits: logits must have unit stride along V, got strides ", logits.strides());
  c10::cuda::CUDAGuard guard(logits.device());

  const auto float_options = logits.options();
  SampleResult result;
  result.tokens = at::empty({batch, num_samples}, logits.options().dtype(at::kLong));
  result.scores = at::empty({batch, num_samples}, float_options);
  result.token_logprobs =
      return_logprobs ? at::empty({batch, num_samples}, float_options) : at::empty({0}, float_options);
  result.logsumexp = return_logprobs ? at::empty({batch}, float_options) : at::empty({0}, float_options);
  if (batch == 0) return {result.tokens, result.scores, result.token_logprobs, result.logsumexp};
  check_mask_rows_nonempty(weight, args, current_stream_capturing());

  std::vector<at::Tensor> keep_alive;
  LogitsSamplerParams p;
  p.logits = logits.const_data_ptr<float>();
  p.logits_row_stride = batch == 1 ? vocab : logits.stride(0);
  p.batch_size = batch;
  p.vocab_size = vocab;
  p.vocab_start = vocab_start;
  p.logit_bias = kept_data<float>(logit_bias, keep_alive);
  p.allowed_mask = kept_data<uint32_t>(allowed_mask, keep_alive);
  p.mask_words = (vocab + 31) / 32;
  p.inv_temperature = fs_inv_temperature(static_cast<float>(temperature));
  p.temperatures = kept_data<float>(temperatures, keep_alive);
  const RowTruncationArrays row_truncation = row_truncation_arrays(top_ks, top_ps, min_ps, batch, keep_alive);
  p.top_k = top_k;
  p.top_ks = row_truncation.top_ks;
  p.top_p = top_p;
  p.top_ps = row_truncation.top_ps;
  p.min_p = min_p;
  p.min_ps = row_truncation.min_ps;
  p.noise = resolve_noise(logits, num_samples, seed, offset, args.generator, std::nullopt, keep_alive);
  p.num_samples = static_cast<int>(num_samples);
  p.tokens = result.tokens.data_ptr<int64_t>();
  p.scores = result.scores.data_ptr<float>();
  if (return_logprobs) {
    p.token_logprobs = result.token_logprobs.data_ptr<float>();
    p.logsumexp = result.logsumexp.data_ptr<float>();
  }
  p.empty_mask_token = empty_mask_token.value_or(-1);
  TORCH_CHECK(num_samples <= INT32_MAX, "flashsampling.sample_from_logits: num_samples must be < 2^31, got ",
              num_samples);
  const DeviceInfo device = device_info(logits.get_device());
  TORCH_CHECK_NOT_IMPLEMENTED(device.arch >= 90, "flashsampling.sample_from_logits: needs thread block clusters "
                              "(sm_90 or newer), got sm_", device.arch);
  const size_t workspace_bytes = sample_from_logits_workspace_bytes(p, device.sm_count);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(workspace_bytes)}, logits.options().dtype(at::kByte));
  check_cuda_launch(launch_widen_row_truncation(row_truncation.widening, c10::cuda::getCurrentCUDAStream()),
                    "flashsampling.sample_from_logits");
  check_cuda_launch(launch_sample_from_logits(p, workspace_bytes > 0 ? workspace.data_ptr() : nullptr, device.sm_count,
                                              c10::cuda::getCurrentCUDAStream()),
                    "flashsampling.sample_from_logits");
  return {result.tokens, result.scores, result.token_logprobs, result.logsumexp};
}

}  // namespace

// Test hook: variants of the dispatch that must give the same tokens (DispatchOptions), for the
// process, until set again; tests/test_sample_cuda.py compares them in one process.
static void set_dispatch_options(bool column_clusters, bool pad_columns, bool noise_skip, bool lse_references,
                                 bool top_candidates_epilogue_warpgroups, bool top_p_tile_winners,
                                 bool narrow_ragged_columns, bool top_p_on_plain_pass, bool min_p_on_plain_pass,
                                 bool first_winners_in_reduction, bool narrow_plain_pass,
                                 bool min_p_filtered_winners) {
  DispatchOptions options;
  options.column_clusters = column_clusters;
  options.pad_columns = pad_columns;
  options.noise_skip = noise_skip;
  options.lse_references = lse_references;
  options.top_candidates_epilogue_warpgroups = top_candidates_epilogue_warpgroups;
  options.top_p_tile_winners = top_p_tile_winners;
  options.narrow_ragged_columns = narrow_ragged_columns;
  options.top_p_on_plain_pass = top_p_on_plain_pass;
  options.min_p_on_plain_pass = min_p_on_plain_pass;
  options.first_winners_in_reduction = first_winners_in_reduction;
  options.narrow_plain_pass = narrow_plain_pass;
  options.min_p_filtered_winners = min_p_filtered_winners;
  set_sampler_dispatch_options(options);
}

TORCH_LIBRARY_FRAGMENT(flashsampling, m) {
  m.def("_set_dispatch_options(bool column_clusters=True, bool pad_columns=True, bool noise_skip=True, "
        "bool lse_references=True, bool top_candidates_epilogue_warpgroups=True, bool top_p_tile_winners=True, "
        "bool narrow_ragged_columns=True, bool top_p_on_plain_pass=True, bool min_p_on_plain_pass=True, "
        "bool first_winners_in_reduction=True, bool narrow_plain_pass=True, bool min_p_filtered_winners=True) -> ()",
        &set_dispatch_options);
}

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) {
  SampleOps<&sample_cuda>::register_impls(m);
  m.impl("sample_top_k", &sample_top_k_cuda);
  m.impl("_sample_top_logprobs", &sample_top_logprobs_cuda);
  m.impl("_sample_positions", &sample_positions_cuda);
  m.impl("sample_from_logits", &sample_from_logits_cuda);
}

}  // namespace flashsampling
