// CUDA impls of flashsampling._logf, _gumbel_from_bits and _gumbel_upper_bound (the fused
// kernels' skip bound; the CPU ones are in noise_cpu.cpp): the noise transforms as the GPU
// computes them, for tests that compare the two bit for bit; and of _uniform_noise, speculative
// verification's acceptance draws in one kernel; and of _model_logits, the logits route's scale
// and soft-cap.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda_launch_check.h"
#include "flashsampling/noise_launch.h"

namespace flashsampling {
namespace {

at::Tensor logf_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "flashsampling._logf: x must be float32, got ", x.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  check_cuda_launch(launch_logf(xc.const_data_ptr<float>(), out.mutable_data_ptr<float>(), xc.numel(),
                                c10::cuda::getCurrentCUDAStream()),
                    "flashsampling._logf");
  return out;
}

at::Tensor model_logits_cuda(const at::Tensor& logits, double logit_scale, std::optional<double> logit_softcap) {
  const ModelTransform t = model_logits_args(logits, logit_scale, logit_softcap);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor xc = logits.contiguous();
  at::Tensor out = at::empty_like(xc);
  check_cuda_launch(launch_model_logits(xc.const_data_ptr<float>(), out.mutable_data_ptr<float>(), xc.numel(),
                                        t.scale, t.softcap, t.inv_softcap, c10::cuda::getCurrentCUDAStream()),
                    "flashsampling._model_logits");
  return out;
}

// A float per uint32 value of `bits` (int64), by `launch`.
template <class Launch>
at::Tensor map_bits_cuda(const at::Tensor& bits, const char* op, Launch launch) {
  const c10::cuda::CUDAGuard guard(bits.device());
  check_uint32_values(op, "bits", bits);
  const at::Tensor bc = bits.contiguous();
  at::Tensor out = at::empty(bc.sizes(), bc.options().dtype(at::kFloat));
  check_cuda_launch(launch(bc.const_data_ptr<int64_t>(), out.mutable_data_ptr<float>(), bc.numel(),
                           c10::cuda::getCurrentCUDAStream()),
                    op);
  return out;
}

at::Tensor gumbel_from_bits_cuda(const at::Tensor& bits) {
  return map_bits_cuda(bits, "flashsampling._gumbel_from_bits", launch_gumbel_from_bits);
}

at::Tensor gumbel_upper_bound_cuda(const at::Tensor& bits) {
  return map_bits_cuda(bits, "flashsampling._gumbel_upper_bound", launch_gumbel_upper_bound);
}

at::Tensor uniform_noise_cuda(const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& stream,
                              const at::Tensor& sample, const at::Tensor& vocab_index) {
  check_uniform_noise_args(seed, offset, stream, sample, vocab_index);
  const c10::cuda::CUDAGuard guard(seed.device());
  const at::Tensor se = seed.contiguous(), of = offset.contiguous(), st = stream.contiguous(),
                   sa = sample.contiguous(), vo = vocab_index.contiguous();
  at::Tensor out = at::empty(seed.sizes(), seed.options().dtype(at::kFloat));
  check_cuda_launch(launch_uniform_noise(se.const_data_ptr<int64_t>(), of.const_data_ptr<int64_t>(),
                                         st.const_data_ptr<int64_t>(), sa.const_data_ptr<int64_t>(),
                                         vo.const_data_ptr<int64_t>(), out.mutable_data_ptr<float>(), out.numel(),
                                         c10::cuda::getCurrentCUDAStream()),
                    "flashsampling._uniform_noise");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) {
  m.impl("_uniform_noise", &uniform_noise_cuda);
  m.impl("_logf", &logf_cuda);
  m.impl("_model_logits", &model_logits_cuda);
  m.impl("_gumbel_from_bits", &gumbel_from_bits_cuda);
  m.impl("_gumbel_upper_bound", &gumbel_upper_bound_cuda);
}

}  // namespace flashsampling
