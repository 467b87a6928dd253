// CUDA impls of flashsampling._draft_position_stats and _stop_row_logits (flashsampling/
// draft_rows_launch.h): speculative verification with sampled drafts; flashsampling_cuda/
// speculative.py has their CPU kernels in torch ops (the tests' reference for these).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

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
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == batch && lse.size(1) == draft_probs.size(1) &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.device() == logits.device(),
              kOp, ": lse must be contiguous float32 [B, n]");
  for (auto [name, t, dtype] : {std::tuple{"stop", &stop, at::kLong}, std::tuple{"residual", &residual, at::kBool}}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == batch && t->scalar_type() == dtype && t->is_contiguous() &&
                    t->device() == logits.device(),
                kOp, ": ", name, " must be contiguous [", batch, "] of ", dtype, " on ", logits.device());
  }
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

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) {
  m.impl("_draft_position_stats", &draft_position_stats_cuda);
  m.impl("_stop_row_logits", &stop_row_logits_cuda);
}

}  // namespace flashsampling
