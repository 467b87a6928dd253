// CUDA impls of flashsampling._shard_keys and _merge_shard_keys (the CPU ones, and what they
// compute, are in shard_keys_cpu.cpp): one kernel each on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "checks.h"
#include "cuda_launch_check.h"
#include "flashsampling/shard_keys_launch.h"

namespace flashsampling {
namespace {

at::Tensor shard_keys_cuda(const at::Tensor& tokens, const at::Tensor& scores) {
  check_shard_keys_args(tokens, scores);
  const c10::cuda::CUDAGuard guard(tokens.device());
  const at::Tensor t = tokens.contiguous(), s = scores.contiguous();
  at::Tensor keys = at::empty_like(t);
  check_cuda_launch(launch_shard_keys(t.const_data_ptr<int64_t>(), s.const_data_ptr<float>(),
                                      keys.mutable_data_ptr<int64_t>(), t.numel(), c10::cuda::getCurrentCUDAStream()),
                    "flashsampling._shard_keys");
  return keys;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_shard_keys_cuda(const at::Tensor& gathered,
                                                                     int64_t num_samples, int64_t mask_empty_token) {
  check_merge_shard_keys_args(gathered, num_samples);
  const c10::cuda::CUDAGuard guard(gathered.device());
  const at::Tensor g = gathered.contiguous();
  const int64_t rows = g.size(1);
  at::Tensor best = at::empty({rows, num_samples}, g.options());
  at::Tensor winner = at::empty_like(best), tokens = at::empty_like(best);
  check_cuda_launch(launch_merge_shard_keys(g.const_data_ptr<int64_t>(), g.size(0), rows, g.size(2), num_samples,
                                            mask_empty_token, best.mutable_data_ptr<int64_t>(),
                                            winner.mutable_data_ptr<int64_t>(), tokens.mutable_data_ptr<int64_t>(),
                                            c10::cuda::getCurrentCUDAStream()),
                    "flashsampling._merge_shard_keys");
  return {best, winner, tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) {
  m.impl("_shard_keys", &shard_keys_cuda);
  m.impl("_merge_shard_keys", &merge_shard_keys_cuda);
}

}  // namespace flashsampling
