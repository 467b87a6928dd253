// CUDA impls of flashsampling._top_logprobs and _row_logsumexp (flashsampling/top_logprobs.h; the
// CPU computes the same outputs in torch ops, flashsampling_cuda/logprobs.py): their launches on
// the current stream, the first with a workspace of top_logprobs_workspace_bytes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "cuda_device_info.h"
#include "cuda_launch_check.h"
#include "flashsampling/top_logprobs.h"

namespace flashsampling {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> top_logprobs_cuda(const at::Tensor& values, const at::Tensor& lse,
                                                                 const at::Tensor& tokens, int64_t top_n, bool raw,
                                                                 const std::optional<at::Tensor>& scales) {
  const char* prefix = "flashsampling._top_logprobs: ";
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kFloat, prefix,
              "values must be a float32 [B, V] tensor, got ", values.scalar_type(), " with shape ", values.sizes());
  const int64_t batch = values.size(0), vocab = values.size(1);
  TORCH_CHECK(vocab >= 1 && vocab < (int64_t{1} << 32), prefix, "values must have 1 <= V < 2^32, got V = ", vocab);
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == batch && lse.scalar_type() == at::kDouble, prefix,
              "lse must be a float64 [B] tensor with B = ", batch, ", got ", lse.scalar_type(), " with shape ",
              lse.sizes());
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(0) == batch && tokens.scalar_type() == at::kLong, prefix,
              "tokens must be an int64 [B, S] tensor with B = ", batch, ", got ", tokens.scalar_type(),
              " with shape ", tokens.sizes());
  TORCH_CHECK(top_n >= 0 && top_n <= kMaxTopLogprobs && top_n <= vocab, prefix, "top_n must be in [0, min(V, ",
              kMaxTopLogprobs, ")], got ", top_n);
  TORCH_CHECK(!scales.has_value() || (scales->dim() == 1 && scales->size(0) == batch &&
                                      scales->scalar_type() == at::kFloat),
              prefix, "scales must be a float32 [B] tensor with B = ", batch);
  for (const at::Tensor* t : {&lse, &tokens, scales.has_value() ? &*scales : &lse}) {
    TORCH_CHECK(t->device() == values.device(), prefix, "every tensor must be on values' device (", values.device(),
                "), got ", t->device());
  }
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor v = values.stride(1) == 1 ? values : values.contiguous();
  const at::Tensor l = lse.contiguous(), t = tokens.contiguous();
  const at::Tensor s = scales.has_value() ? scales->contiguous() : at::Tensor();
  at::Tensor top_values = at::empty({batch, top_n}, values.options());
  at::Tensor top_ids = at::empty({batch, top_n}, tokens.options());
  at::Tensor ranks = at::empty({batch, tokens.size(1)}, tokens.options());
  TopLogprobsParams p;
  p.values = v.const_data_ptr<float>();
  p.row_stride = v.stride(0);
  p.batch_size = batch;
  p.vocab_size = vocab;
  p.lse = l.const_data_ptr<double>();
  p.scales = s.defined() ? s.const_data_ptr<float>() : nullptr;
  p.raw = raw;
  p.tokens = t.const_data_ptr<int64_t>();
  p.num_samples = t.size(1);
  p.top_n = static_cast<int>(top_n);
  p.top_values = top_values.mutable_data_ptr<float>();
  p.top_ids = top_ids.mutable_data_ptr<int64_t>();
  p.ranks = ranks.mutable_data_ptr<int64_t>();
  at::Tensor workspace = at::empty({static_cast<int64_t>((top_logprobs_workspace_bytes(batch, t.size(1)) + 7) / 8)},
                                   tokens.options());  // int64 words: 8-byte aligned
  int const sm_count = device_info(values.get_device()).sm_count;
  check_cuda_launch(launch_top_logprobs(p, workspace.mutable_data_ptr(), sm_count, c10::cuda::getCurrentCUDAStream()),
                    "flashsampling._top_logprobs");
  return {top_values, top_ids, ranks};
}

at::Tensor row_logsumexp_cuda(const at::Tensor& values) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kFloat,
              "flashsampling._row_logsumexp: values must be a float32 [B, V] tensor, got ", values.scalar_type(),
              " with shape ", values.sizes());
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor v = values.stride(1) == 1 ? values : values.contiguous();
  at::Tensor lse = at::empty({values.size(0)}, values.options());
  check_cuda_launch(launch_row_logsumexp(v.const_data_ptr<float>(), v.stride(0), v.size(0), v.size(1),
                                         lse.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
                    "flashsampling._row_logsumexp");
  return lse;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) {
  m.impl("_top_logprobs", &top_logprobs_cuda);
  m.impl("_row_logsumexp", &row_logsumexp_cuda);
}

}  // namespace flashsampling
