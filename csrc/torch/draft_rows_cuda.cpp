// CUDA impls of flashsampling._draft_position_stats, _stop_row_logits, _accept_drafts and
// _draft_tokens (flashsampling/draft_rows_launch.h): speculative verification; flashsampling_cuda/
// speculative.py has their CPU kernels in torch ops (the tests' reference for these).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <utility>

#include "cuda_launch_check.h"
#include "flashsampling/draft_rows_launch.h"

namespace flashsampling {
namespace {

// logits float32 [B, P, V] contiguous, scales float32 [B], allowed bool [B, P, V] (optional), all
// on one CUDA device.
void check_rows(const char* op, const at::Tensor& logits, const at::Tensor& scales,
                const std::optional<at::Tensor>& allowed) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.is_cuda(),
              op, ": logits must be contiguous float32 [B, P, V] on CUDA, got ", logits.scalar_type(), " ",
              logits.sizes());
  TORCH_CHECK(logits.size(2) >= 1 && logits.size(2) <= (int64_t{1} << 26), op,
              ": logits must have 1 <= V <= 2^26, got V = ", logits.size(2));
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == logits.size(0) && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.device() == logits.device(),
              op, ": scales must be contiguous float32 [", logits.size(0), "] on ", logits.device());
  TORCH_CHECK(!allowed.has_value() || (allowed->scalar_type() == at::kBool && allowed->sizes() == logits.sizes() &&
                                       allowed->is_contiguous() && allowed->device() == logits.device()),
              op, ": allowed must be contiguous bool ", logits.sizes(), " on ", logits.device());
}

// t is a `dtype` tensor of `sizes` on `device`, contiguous unless `contiguous` is false (op: the
// error's prefix).
void check_operand(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef sizes, at::ScalarType dtype,
                   const at::Device& device, bool contiguous = true) {
  TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == dtype && (!contiguous || t.is_contiguous()) &&
                  t.device() == device,
              op, ": ", name, " must be ", contiguous ? "contiguous " : "", dtype, " ", sizes, " on ", device, ", got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_position_stats_cuda(const at::Tensor& logits,
                                                                         const at::Tensor& scales,
                                                                         const at::Tensor& draft_columns,
                                                                         const std::optional<at::Tensor>& allowed) {
  constexpr const char* kOp = "flashsampling._draft_position_stats";
  check_rows(kOp, logits, scales, allowed);
  TORCH_CHECK(draft_columns.dim() == 2 && draft_columns.size(0) == logits.size(0) &&
                  draft_columns.size(1) <= logits.size(1) && draft_columns.scalar_type() == at::kLong &&
                  draft_columns.device() == logits.device(),
              kOp, ": draft_columns must be int64 [B, J] with J <= P on the logits' device, got ",
              draft_columns.scalar_type(), " ", draft_columns.sizes());
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor columns = draft_columns.contiguous();
  DraftPositionStatsParams p;
  p.batch = logits.size(0);
  p.positions = logits.size(1);
  p.vocab = logits.size(2);
  p.columns = columns.size(1);
  p.logits = logits.const_data_ptr<float>();
  p.scales = scales.const_data_ptr<float>();
  p.draft_columns = columns.const_data_ptr<int64_t>();
  p.allowed = allowed.has_value() ? allowed->const_data_ptr<bool>() : nullptr;
  at::Tensor lse = at::empty(columns.sizes(), logits.options());
  at::Tensor argmax = at::empty(columns.sizes(), columns.options());
  at::Tensor y_draft = at::empty(columns.sizes(), logits.options());
  p.lse = lse.mutable_data_ptr<float>();
  p.argmax = argmax.mutable_data_ptr<int64_t>();
  p.y_draft = y_draft.mutable_data_ptr<float>();
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(draft_position_stats_workspace_bytes(p))}, logits.options().dtype(at::kByte));
  check_cuda_launch(launch_draft_position_stats(p, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()), kOp);
  return {lse, argmax, y_draft};
}

at::Tensor stop_row_logits_cuda(const at::Tensor& logits, const at::Tensor& draft_probs, const at::Tensor& stop,
                                const at::Tensor& scales, const at::Tensor& lse, const at::Tensor& residual,
                                const std::optional<at::Tensor>& allowed) {
  constexpr const char* kOp = "flashsampling._stop_row_logits";
  check_rows(kOp, logits, scales, allowed);
  const int64_t batch = logits.size(0), vocab = logits.size(2);
  TORCH_CHECK(draft_probs.dim() == 3 && draft_probs.size(0) == batch && draft_probs.size(2) == vocab &&
                  draft_probs.size(1) < logits.size(1) && draft_probs.scalar_type() == at::kFloat &&
                  draft_probs.is_contiguous() && draft_probs.device() == logits.device(),
              kOp, ": draft_probs must be contiguous float32 [B, n, V] with n < P, got ", draft_probs.scalar_type(),
              " ", draft_probs.sizes());
  check_operand(kOp, "lse", lse, {batch, draft_probs.size(1)}, at::kFloat, logits.device());
  check_operand(kOp, "stop", stop, {batch}, at::kLong, logits.device());
  check_operand(kOp, "residual", residual, {batch}, at::kBool, logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  StopRowLogitsParams p;
  p.batch = batch;
  p.positions = logits.size(1);
  p.vocab = vocab;
  p.drafts = draft_probs.size(1);
  p.logits = logits.const_data_ptr<float>();
  p.draft_probs = draft_probs.const_data_ptr<float>();
  p.stop = stop.const_data_ptr<int64_t>();
  p.scales = scales.const_data_ptr<float>();
  p.lse = lse.const_data_ptr<float>();
  p.residual = residual.const_data_ptr<bool>();
  p.allowed = allowed.has_value() ? allowed->const_data_ptr<bool>() : nullptr;
  at::Tensor out = at::empty({batch, vocab}, logits.options());
  p.out = out.mutable_data_ptr<float>();
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(stop_row_logits_workspace_bytes(p))}, logits.options().dtype(at::kByte));
  check_cuda_launch(launch_stop_row_logits(p, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()), kOp);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> accept_drafts_cuda(
    const at::Tensor& lse, const at::Tensor& argmax, const at::Tensor& y_draft, const at::Tensor& draft_columns,
    const at::Tensor& draft_probs, const at::Tensor& seeds, const at::Tensor& offsets, const at::Tensor& streams,
    const at::Tensor& temps) {
  constexpr const char* kOp = "flashsampling._accept_drafts";
  TORCH_CHECK(draft_probs.dim() == 3 && draft_probs.is_cuda(), kOp, ": draft_probs must be [B, n, V] on CUDA, got ",
              draft_probs.sizes());
  const int64_t batch = draft_probs.size(0), drafts = draft_probs.size(1), vocab = draft_probs.size(2);
  const at::Device device = draft_probs.device();
  check_operand(kOp, "draft_probs", draft_probs, {batch, drafts, vocab}, at::kFloat, device);
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == batch && lse.size(1) >= drafts, kOp,
              ": lse must be [B, J] with J >= n = ", drafts, ", got ", lse.sizes());
  const int64_t width = lse.size(1);
  check_operand(kOp, "lse", lse, {batch, width}, at::kFloat, device);
  check_operand(kOp, "argmax", argmax, {batch, width}, at::kLong, device);
  check_operand(kOp, "y_draft", y_draft, {batch, width}, at::kFloat, device);
  check_operand(kOp, "draft_columns", draft_columns, {batch, drafts}, at::kLong, device);
  // [B] operands may be expanded views of one value (stride 0), as speculative.py's step holds them.
  check_operand(kOp, "seeds", seeds, {batch}, at::kLong, device, /*contiguous=*/false);
  check_operand(kOp, "offsets", offsets, {batch}, at::kLong, device, /*contiguous=*/false);
  check_operand(kOp, "streams", streams, {batch}, at::kLong, device, /*contiguous=*/false);
  check_operand(kOp, "temps", temps, {batch}, at::kFloat, device, /*contiguous=*/false);
  const c10::cuda::CUDAGuard guard(device);
  AcceptDraftsParams p;
  p.batch = batch;
  p.drafts = drafts;
  p.vocab = vocab;
  p.stats_stride = width;
  p.lse = lse.const_data_ptr<float>();
  p.argmax = argmax.const_data_ptr<int64_t>();
  p.y_draft = y_draft.const_data_ptr<float>();
  p.draft_columns = draft_columns.const_data_ptr<int64_t>();
  p.draft_probs = draft_probs.const_data_ptr<float>();
  p.seeds = seeds.const_data_ptr<int64_t>();
  p.offsets = offsets.const_data_ptr<int64_t>();
  p.streams = streams.const_data_ptr<int64_t>();
  p.temps = temps.const_data_ptr<float>();
  p.seed_stride = seeds.stride(0);
  p.offset_stride = offsets.stride(0);
  p.stream_stride = streams.stride(0);
  p.temp_stride = temps.stride(0);
  const at::TensorOptions int64_options = seeds.options().dtype(at::kLong);
  at::Tensor num_accepted = at::empty({batch}, int64_options);
  at::Tensor residual = at::empty({batch}, int64_options.dtype(at::kBool));
  at::Tensor sample_temps = at::empty({batch}, int64_options.dtype(at::kFloat));
  at::Tensor sample_offsets = at::empty({batch}, int64_options);
  p.num_accepted = num_accepted.mutable_data_ptr<int64_t>();
  p.residual = residual.mutable_data_ptr<bool>();
  p.sample_temps = sample_temps.mutable_data_ptr<float>();
  p.sample_offsets = sample_offsets.mutable_data_ptr<int64_t>();
  check_cuda_launch(launch_accept_drafts(p, c10::cuda::getCurrentCUDAStream()), kOp);
  return {num_accepted, residual, sample_temps, sample_offsets};
}

std::tuple<at::Tensor, at::Tensor> draft_tokens_cuda(const at::Tensor& draft_token_ids, const at::Tensor& emitted,
                                                     const std::optional<at::Tensor>& num_accepted) {
  constexpr const char* kOp = "flashsampling._draft_tokens";
  TORCH_CHECK(draft_token_ids.dim() == 2 && draft_token_ids.is_cuda(), kOp,
              ": draft_token_ids must be [B, n] on CUDA, got ", draft_token_ids.sizes());
  const int64_t batch = draft_token_ids.size(0), drafts = draft_token_ids.size(1);
  const at::Device device = draft_token_ids.device();
  check_operand(kOp, "draft_token_ids", draft_token_ids, {batch, drafts}, at::kLong, device);
  const bool width_ok = emitted.dim() == 2 && (emitted.size(1) == drafts + 1 ||
                                                (num_accepted.has_value() && emitted.size(1) == 1));
  TORCH_CHECK(width_ok, kOp, ": emitted must be [B, n + 1], or [B, 1] with num_accepted, got ", emitted.sizes());
  check_operand(kOp, "emitted", emitted, {batch, emitted.size(1)}, at::kLong, device);
  if (num_accepted.has_value()) check_operand(kOp, "num_accepted", *num_accepted, {batch}, at::kLong, device);
  const c10::cuda::CUDAGuard guard(device);
  DraftTokensParams p;
  p.batch = batch;
  p.drafts = drafts;
  p.emitted_width = emitted.size(1);
  p.draft_token_ids = draft_token_ids.const_data_ptr<int64_t>();
  p.emitted = emitted.const_data_ptr<int64_t>();
  p.num_accepted = num_accepted.has_value() ? num_accepted->const_data_ptr<int64_t>() : nullptr;
  at::Tensor tokens = at::empty({batch, drafts + 1}, emitted.options());
  at::Tensor counts = at::empty({batch}, emitted.options());
  p.tokens = tokens.mutable_data_ptr<int64_t>();
  p.num_accepted_out = counts.mutable_data_ptr<int64_t>();
  check_cuda_launch(launch_draft_tokens(p, c10::cuda::getCurrentCUDAStream()), kOp);
  return {tokens, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) {
  m.impl("_draft_position_stats", &draft_position_stats_cuda);
  m.impl("_stop_row_logits", &stop_row_logits_cuda);
  m.impl("_accept_drafts", &accept_drafts_cuda);
  m.impl("_draft_tokens", &draft_tokens_cuda);
}

}  // namespace flashsampling
