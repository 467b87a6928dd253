// CUDA impl of flashsampling._penalty_values (flashsampling/penalty_values_launch.h): step 3's
// added value per seen token in one launch; flashsampling_cuda/penalties.py (fused_penalty_args)
// calls it on CUDA and computes the same bits in torch ops elsewhere.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda_launch_check.h"
#include "flashsampling/penalty_values_launch.h"

namespace flashsampling {
namespace {

at::Tensor penalty_values_cuda(const at::Tensor& ids, const at::Tensor& output_counts,
                               std::optional<double> frequency, const std::optional<at::Tensor>& frequencies,
                               std::optional<double> presence, const std::optional<at::Tensor>& presences) {
  constexpr const char* kOp = "flashsampling._penalty_values";
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, kOp, ": ids must be int64 [B, C], got ",
              ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK(output_counts.scalar_type() == at::kInt && output_counts.sizes() == ids.sizes() &&
                  output_counts.device() == ids.device(),
              kOp, ": output_counts must be int32 with ids' shape ", ids.sizes(), " on ", ids.device());
  const int64_t batch = ids.size(0);
  for (auto [name, t] : {std::pair{"frequencies", &frequencies}, std::pair{"presences", &presences}}) {
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kFloat && (*t)->dim() == 1 &&
                                     (*t)->size(0) == batch && (*t)->device() == ids.device()),
                kOp, ": ", name, " must be float32 [", batch, "] on ", ids.device());
  }
  const c10::cuda::CUDAGuard guard(ids.device());
  const at::Tensor i = ids.contiguous(), c = output_counts.contiguous();
  at::Tensor f, p;
  PenaltyValuesParams params;
  params.batch = batch;
  params.capacity = ids.size(1);
  params.ids = i.const_data_ptr<int64_t>();
  params.counts = c.const_data_ptr<int32_t>();
  params.frequency_on = frequency.has_value() || frequencies.has_value();
  params.presence_on = presence.has_value() || presences.has_value();
  params.frequency = static_cast<float>(frequency.value_or(0.0));
  params.presence = static_cast<float>(presence.value_or(0.0));
  if (frequencies.has_value()) {
    f = frequencies->contiguous();
    params.frequencies = f.const_data_ptr<float>();
  }
  if (presences.has_value()) {
    p = presences->contiguous();
    params.presences = p.const_data_ptr<float>();
  }
  at::Tensor out = at::empty(ids.sizes(), ids.options().dtype(at::kFloat));
  params.out = out.mutable_data_ptr<float>();
  check_cuda_launch(launch_penalty_values(params, c10::cuda::getCurrentCUDAStream()), kOp);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) { m.impl("_penalty_values", &penalty_values_cuda); }

}  // namespace flashsampling
