// CPU impls of flashsampling._shard_keys and _merge_shard_keys, the tensor-parallel exchange's
// key encoding and merge (flashsampling/shard_keys.h; flashsampling_cuda/distributed.py, which
// also registers their fake impls). The CUDA impls are in shard_keys_cuda.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "checks.h"
#include "flashsampling/shard_keys.h"

namespace flashsampling {
namespace {

at::Tensor shard_keys_cpu(const at::Tensor& tokens, const at::Tensor& scores) {
  check_shard_keys_args(tokens, scores);
  const at::Tensor t = tokens.contiguous(), s = scores.contiguous();
  at::Tensor keys = at::empty_like(t);
  const int64_t* tp = t.const_data_ptr<int64_t>();
  const float* sp = s.const_data_ptr<float>();
  int64_t* kp = keys.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) kp[i] = fs_shard_key(tp[i], sp[i]);
  return keys;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_shard_keys_cpu(const at::Tensor& gathered, int64_t num_samples,
                                                                    int64_t mask_empty_token) {
  check_merge_shard_keys_args(gathered, num_samples);
  const at::Tensor g = gathered.contiguous();
  const int64_t world = g.size(0), rows = g.size(1), row_stride = g.size(2);
  at::Tensor best = at::empty({rows, num_samples}, g.options());
  at::Tensor winner = at::empty_like(best), tokens = at::empty_like(best);
  const int64_t* gp = g.const_data_ptr<int64_t>();
  int64_t *bp = best.mutable_data_ptr<int64_t>(), *wp = winner.mutable_data_ptr<int64_t>(),
          *tp = tokens.mutable_data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t s = 0; s < num_samples; ++s) {
      const int64_t i = row * num_samples + s;
      fs_merge_shard_keys(gp + row * row_stride + s, rows * row_stride, world, mask_empty_token, bp[i], wp[i], tp[i]);
    }
  }
  return {best, winner, tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CPU, m) {
  m.impl("_shard_keys", &shard_keys_cpu);
  m.impl("_merge_shard_keys", &merge_shard_keys_cpu);
}

}  // namespace flashsampling
