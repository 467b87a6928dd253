// CUDA impls of flashsampling._speculative_rows and _speculative_finish, the two small kernels
// around the fused op in one-hot speculative verification (flashsampling/speculative_launch.h;
// flashsampling_cuda/speculative.py, verify_one_hot_fused, checks the step's arguments and
// passes them here in the shapes below). CUDA only: the CPU verifies from its logits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda_launch_check.h"
#include "flashsampling/speculative_launch.h"

namespace flashsampling {
namespace {

// A [rows, ...] tensor of `dtype` on `device`, contiguous (a copy where it is not).
at::Tensor checked(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                   const at::Device& device, at::IntArrayRef shape) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  return t.contiguous();
}

// A [B] tensor of `dtype` on `device` read in place: contiguous or one value expanded (stride 0).
template <typename T>
RowValues<T> row_values(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                        const at::Device& device, int64_t batch) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch && (batch <= 1 || t.stride(0) == 0 || t.stride(0) == 1), op, ": ",
              name, " must be a [", batch, "] tensor, contiguous or expanded, got shape ", t.sizes(), " and strides ",
              t.strides());
  return RowValues<T>{t.const_data_ptr<T>(), batch <= 1 ? 0 : t.stride(0)};
}

// The step's per-batch-row temperatures and noise keys, read in place.
RowKeys row_keys(const char* op, const at::Tensor& temperatures, const at::Tensor& seeds, const at::Tensor& offsets,
                 const at::Tensor& streams, const at::Device& device, int64_t batch) {
  return RowKeys{row_values<float>(op, "temperatures", temperatures, at::kFloat, device, batch),
                 row_values<int64_t>(op, "seeds", seeds, at::kLong, device, batch),
                 row_values<int64_t>(op, "offsets", offsets, at::kLong, device, batch),
                 row_values<int64_t>(op, "streams", streams, at::kLong, device, batch)};
}

// The rows' int32 mask [B, words] as the kernels' words (nullptr without one); `held` keeps its
// contiguous data alive until the launch.
const uint32_t* mask_words(const char* op, const std::optional<at::Tensor>& allowed_mask, const at::Device& device,
                           int64_t batch, int64_t words, at::Tensor& held) {
  if (!allowed_mask.has_value()) return nullptr;
  held = checked(op, "allowed_mask", *allowed_mask, at::kInt, device, {batch, words});
  return reinterpret_cast<const uint32_t*>(held.const_data_ptr<int32_t>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> speculative_rows_cuda(
    const at::Tensor& drafts, const at::Tensor& temperatures, const at::Tensor& seeds, const at::Tensor& offsets,
    const at::Tensor& streams, const std::optional<at::Tensor>& allowed_mask, int64_t vocab, int64_t vocab_start) {
  constexpr const char* kOp = "flashsampling._speculative_rows";
  TORCH_CHECK(drafts.dim() == 2, kOp, ": drafts must be [B, n], got ", drafts.sizes());
  TORCH_CHECK(vocab >= 1, kOp, ": vocab must be >= 1, got ", vocab);
  const c10::cuda::CUDAGuard guard(drafts.device());
  const int64_t batch = drafts.size(0), n = drafts.size(1), words = (vocab + 31) / 32;
  SpeculativeRowsParams p;
  p.batch = batch;
  p.n = n;
  p.words = words;
  p.vocab = vocab;
  p.vocab_start = vocab_start;
  const at::Tensor d = checked(kOp, "drafts", drafts, at::kLong, drafts.device(), {batch, n});
  p.keys = row_keys(kOp, temperatures, seeds, offsets, streams, drafts.device(), batch);
  at::Tensor m;
  p.allowed_mask = mask_words(kOp, allowed_mask, drafts.device(), batch, words, m);
  const int64_t rows = (n + 1) * batch;
  at::Tensor masks = at::empty({rows, words}, drafts.options().dtype(at::kInt));
  at::Tensor row_temperatures = at::empty({rows}, drafts.options().dtype(at::kFloat));
  at::Tensor row_seeds = at::empty({rows}, d.options()), row_offsets = at::empty({rows}, d.options()),
             row_streams = at::empty({rows}, d.options());
  p.drafts = d.const_data_ptr<int64_t>();
  p.masks = reinterpret_cast<uint32_t*>(masks.mutable_data_ptr<int32_t>());
  p.row_temperatures = row_temperatures.mutable_data_ptr<float>();
  p.row_seeds = row_seeds.mutable_data_ptr<int64_t>();
  p.row_offsets = row_offsets.mutable_data_ptr<int64_t>();
  p.row_streams = row_streams.mutable_data_ptr<int64_t>();
  check_cuda_launch(launch_speculative_rows(p, c10::cuda::getCurrentCUDAStream()), kOp);
  return {masks, row_temperatures, row_seeds, row_offsets, row_streams};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> speculative_finish_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& drafts, const at::Tensor& emitted,
    const at::Tensor& lse, const std::optional<at::Tensor>& token_logprobs, const at::Tensor& temperatures,
    const at::Tensor& seeds, const at::Tensor& offsets, const at::Tensor& streams,
    const std::optional<at::Tensor>& allowed_mask, const std::optional<at::Tensor>& logit_bias, double logit_scale,
    std::optional<double> logit_softcap, int64_t vocab_start) {
  constexpr const char* kOp = "flashsampling._speculative_finish";
  TORCH_CHECK(hidden.dim() == 3 && weight.dim() == 2 && hidden.size(2) == weight.size(1), kOp,
              ": hidden must be [B, n + 1, D] and weight [V, D], got ", hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kHalf, kOp,
              ": hidden must be bfloat16 or float16, got ", hidden.scalar_type());
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type() && weight.device() == hidden.device() &&
                  weight.stride(1) == 1,
              kOp, ": weight must have hidden's dtype and device and unit stride along D");
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Device device = hidden.device();
  const int64_t batch = hidden.size(0), positions = hidden.size(1), n = positions - 1, dim = hidden.size(2);
  const int64_t vocab = weight.size(0), words = (vocab + 31) / 32, rows = positions * batch;
  TORCH_CHECK(positions >= 1 && positions <= kSpeculativeMaxPositions, kOp, ": n + 1 must be in [1, ",
              kSpeculativeMaxPositions, "], got ", positions);
  const ModelTransform transform = model_transform(logit_scale, logit_softcap);
  SpeculativeFinishParams p;
  p.batch = batch;
  p.n = n;
  p.dim = dim;
  p.vocab = vocab;
  p.vocab_start = vocab_start;
  p.words = words;
  const at::Tensor h = hidden.contiguous();
  p.hidden = h.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.weight_row_stride = weight.stride(0);
  p.bf16 = hidden.scalar_type() == at::kBFloat16;
  const at::Tensor d = checked(kOp, "drafts", drafts, at::kLong, device, {batch, n});
  const at::Tensor e = checked(kOp, "emitted", emitted, at::kLong, device, {rows});
  const at::Tensor l = checked(kOp, "lse", lse, at::kFloat, device, {rows});
  p.keys = row_keys(kOp, temperatures, seeds, offsets, streams, device, batch);
  at::Tensor tl, m, bias;
  if (token_logprobs.has_value()) {
    tl = checked(kOp, "token_logprobs", *token_logprobs, at::kFloat, device, {rows});
    p.token_logprobs = tl.const_data_ptr<float>();
  }
  p.allowed_mask = mask_words(kOp, allowed_mask, device, batch, words, m);
  if (logit_bias.has_value()) {
    bias = checked(kOp, "logit_bias", *logit_bias, at::kFloat, device, {vocab});
    p.logit_bias = bias.const_data_ptr<float>();
  }
  p.drafts = d.const_data_ptr<int64_t>();
  p.emitted = e.const_data_ptr<int64_t>();
  p.lse = l.const_data_ptr<float>();
  p.logit_scale = transform.scale;
  p.logit_softcap = transform.softcap;
  p.inv_logit_softcap = transform.inv_softcap;
  const auto long_options = hidden.options().dtype(at::kLong);
  at::Tensor tokens = at::empty({batch, positions}, long_options);
  at::Tensor num_accepted = at::empty({batch}, long_options);
  at::Tensor logprobs = at::empty({token_logprobs.has_value() ? batch : 0, positions}, hidden.options().dtype(at::kFloat));
  p.tokens = tokens.mutable_data_ptr<int64_t>();
  p.num_accepted = num_accepted.mutable_data_ptr<int64_t>();
  p.logprobs = token_logprobs.has_value() ? logprobs.mutable_data_ptr<float>() : nullptr;
  check_cuda_launch(launch_speculative_finish(p, c10::cuda::getCurrentCUDAStream()), kOp);
  return {tokens, num_accepted, logprobs};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) {
  m.impl("_speculative_rows", &speculative_rows_cuda);
  m.impl("_speculative_finish", &speculative_finish_cuda);
}

}  // namespace flashsampling
