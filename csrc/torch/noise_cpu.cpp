// CPU kernels exposing the noise of philox_gumbel.h (per element; _gumbel_from_bits in the
// four-lane form the fused epilogue uses), so tests can check the header (known answers, log
// accuracy) and compare it bit for bit with the pure-PyTorch port in flashsampling_cuda/noise.py;
// and its model-side transforms (_model_logits: the logits route's scale and soft-cap).
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "flashsampling/philox_gumbel.h"

namespace flashsampling {
namespace {

constexpr int64_t kGrain = 4096;

// Applies fn(i) for i in [0, n) on at::parallel_for threads.
template <typename Fn>
void parallel_elements(int64_t n, const Fn& fn) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

at::Tensor gumbel_noise_cpu(int64_t seed, int64_t offset, const at::Tensor& stream,
                            int64_t sample, const at::Tensor& vocab_index) {
  constexpr const char* kOp = "flashsampling.gumbel_noise";
  check_uint32_values(kOp, "stream", stream);
  check_uint32_values(kOp, "vocab_index", vocab_index);
  TORCH_CHECK(sample >= 0 && sample <= 0xffffffffLL, kOp, ": sample must lie in [0, 2^32), got ",
              sample);
  const auto shape = at::infer_size(stream.sizes(), vocab_index.sizes());
  const at::Tensor streams = stream.expand(shape).contiguous();
  const at::Tensor vocab = vocab_index.expand(shape).contiguous();
  at::Tensor out = at::empty(shape, stream.options().dtype(at::kFloat));
  const int64_t* s = streams.const_data_ptr<int64_t>();
  const int64_t* v = vocab.const_data_ptr<int64_t>();
  float* g = out.mutable_data_ptr<float>();
  parallel_elements(out.numel(), [&](int64_t i) {
    g[i] = fs_gumbel_noise(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                           static_cast<uint32_t>(s[i]), static_cast<uint32_t>(sample),
                           static_cast<uint32_t>(v[i]));
  });
  return out;
}

// counter [..., 4] and key [..., 2] (uint32 values in int64) -> Philox output [..., 4].
at::Tensor uniform_noise_cpu(const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& stream,
                             const at::Tensor& sample, const at::Tensor& vocab_index) {
  check_uniform_noise_args(seed, offset, stream, sample, vocab_index);
  const at::Tensor se = seed.contiguous(), of = offset.contiguous(), st = stream.contiguous(),
                   sa = sample.contiguous(), vo = vocab_index.contiguous();
  at::Tensor out = at::empty(seed.sizes(), seed.options().dtype(at::kFloat));
  const int64_t *s = se.const_data_ptr<int64_t>(), *o = of.const_data_ptr<int64_t>(),
                *t = st.const_data_ptr<int64_t>(), *a = sa.const_data_ptr<int64_t>(),
                *v = vo.const_data_ptr<int64_t>();
  float* u = out.mutable_data_ptr<float>();
  parallel_elements(out.numel(), [&](int64_t i) {
    u[i] = fs_uniform_noise(static_cast<uint64_t>(s[i]), static_cast<uint64_t>(o[i]), static_cast<uint32_t>(t[i]),
                            static_cast<uint32_t>(a[i]), static_cast<uint32_t>(v[i]));
  });
  return out;
}

at::Tensor philox4x32_10_cpu(const at::Tensor& counter, const at::Tensor& key) {
  constexpr const char* kOp = "flashsampling._philox4x32_10";
  check_uint32_values(kOp, "counter", counter);
  check_uint32_values(kOp, "key", key);
  TORCH_CHECK(counter.dim() >= 1 && counter.size(-1) == 4, kOp,
              ": counter must have shape [..., 4], got ", counter.sizes());
  TORCH_CHECK(key.dim() >= 1 && key.size(-1) == 2, kOp, ": key must have shape [..., 2], got ",
              key.sizes());
  auto batch = at::infer_size(counter.sizes().slice(0, counter.dim() - 1),
                             key.sizes().slice(0, key.dim() - 1));
  auto counter_shape = batch, key_shape = batch;
  counter_shape.push_back(4);
  key_shape.push_back(2);
  const at::Tensor c = counter.expand(counter_shape).contiguous();
  const at::Tensor k = key.expand(key_shape).contiguous();
  at::Tensor out = at::empty(counter_shape, counter.options());
  const int64_t* cp = c.const_data_ptr<int64_t>();
  const int64_t* kp = k.const_data_ptr<int64_t>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  parallel_elements(out.numel() / 4, [&](int64_t i) {
    const int64_t* ci = cp + 4 * i;
    const Philox4 r = philox4x32_10(
        Philox4{static_cast<uint32_t>(ci[0]), static_cast<uint32_t>(ci[1]),
                static_cast<uint32_t>(ci[2]), static_cast<uint32_t>(ci[3])},
        static_cast<uint32_t>(kp[2 * i]), static_cast<uint32_t>(kp[2 * i + 1]));
    op[4 * i] = r.x;
    op[4 * i + 1] = r.y;
    op[4 * i + 2] = r.z;
    op[4 * i + 3] = r.w;
  });
  return out;
}

at::Tensor logf_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "flashsampling._logf: x must be float32, got ",
              x.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* xp = xc.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  parallel_elements(out.numel(), [&](int64_t i) { op[i] = fs_logf(xp[i]); });
  return out;
}

// flashsampling._model_logits: fs_model_logit elementwise, the logits route's step 1 (and, with
// scale 1 and softcap 1, fs_tanhf itself for tests/test_noise.py).
at::Tensor model_logits_cpu(const at::Tensor& logits, double logit_scale, std::optional<double> logit_softcap) {
  const ModelTransform t = model_logits_args(logits, logit_scale, logit_softcap);
  const at::Tensor xc = logits.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* xp = xc.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  parallel_elements(out.numel(), [&](int64_t i) { op[i] = fs_model_logit(xp[i], t.scale, t.softcap, t.inv_softcap); });
  return out;
}

// flashsampling._softcap_upper_bound: fs_softcap_upper_bound elementwise (tests/test_noise.py
// checks it against _model_logits).
at::Tensor softcap_upper_bound_cpu(const at::Tensor& logits, double logit_softcap) {
  const ModelTransform t = model_logits_args(logits, 1.0, logit_softcap);
  const at::Tensor xc = logits.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* xp = xc.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  parallel_elements(out.numel(), [&](int64_t i) { op[i] = fs_softcap_upper_bound(xp[i], t.softcap); });
  return out;
}

at::Tensor gumbel_from_bits_cpu(const at::Tensor& bits) {
  check_uint32_values("flashsampling._gumbel_from_bits", "bits", bits);
  const at::Tensor bc = bits.contiguous();
  at::Tensor out = at::empty(bc.sizes(), bc.options().dtype(at::kFloat));
  const int64_t* bp = bc.const_data_ptr<int64_t>();
  float* op = out.mutable_data_ptr<float>();
  // Four lanes at a time, the form the fused epilogue uses (fs_gumbel_from_bits_lanes<4>), so
  // tests/test_noise.py checks it bit for bit against the reference too; the tail one by one.
  const int64_t n = out.numel();
  parallel_elements((n + 3) / 4, [&](int64_t group) {
    const int64_t first = 4 * group;
    if (first + 4 <= n) {
      const uint32_t bits[4] = {static_cast<uint32_t>(bp[first]), static_cast<uint32_t>(bp[first + 1]),
                                static_cast<uint32_t>(bp[first + 2]), static_cast<uint32_t>(bp[first + 3])};
      float gumbel[4];
      fs_gumbel_from_bits_lanes<4>(bits, gumbel);
      for (int j = 0; j < 4; ++j) op[first + j] = gumbel[j];
    } else {
      for (int64_t i = first; i < n; ++i) op[i] = fs_gumbel_from_bits(static_cast<uint32_t>(bp[i]));
    }
  });
  return out;
}

at::Tensor gumbel_upper_bound_cpu(const at::Tensor& bits) {
  check_uint32_values("flashsampling._gumbel_upper_bound", "bits", bits);
  const at::Tensor bc = bits.contiguous();
  at::Tensor out = at::empty(bc.sizes(), bc.options().dtype(at::kFloat));
  const int64_t* bp = bc.const_data_ptr<int64_t>();
  float* op = out.mutable_data_ptr<float>();
  parallel_elements(out.numel(),
                    [&](int64_t i) { op[i] = fs_gumbel_upper_bound_from_bits(static_cast<uint32_t>(bp[i])); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CPU, m) {
  m.impl("gumbel_noise", &gumbel_noise_cpu);
  m.impl("_philox4x32_10", &philox4x32_10_cpu);
  m.impl("_uniform_noise", &uniform_noise_cpu);
  m.impl("_logf", &logf_cpu);
  m.impl("_model_logits", &model_logits_cpu);
  m.impl("_softcap_upper_bound", &softcap_upper_bound_cpu);
  m.impl("_gumbel_from_bits", &gumbel_from_bits_cpu);
  m.impl("_gumbel_upper_bound", &gumbel_upper_bound_cpu);
}

}  // namespace flashsampling
