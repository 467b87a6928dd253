// CUDA impls of the truncation cut's radix search (flashsampling/key_search.h):
// flashsampling._first_order_keys, _order_key_round and _order_key_cut_mask, one kernel each on
// the current stream. flashsampling_cuda/shard_truncation.py runs the rounds (and on the CPU the
// same search in torch ops); these ops are internal and CUDA only.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cuda_device_info.h"
#include "cuda_launch_check.h"
#include "flashsampling/key_search.h"

namespace flashsampling {
namespace {

// y float32 [B, V] on CUDA with unit stride along V; allowed_mask int32 [B, ceil(V / 32)] on its
// device (or absent); row_scales float32 [B] on its device (or absent: y holds the transformed
// logits; present: it holds x, and the kernels take fl32(x * row_scales[b])): the rows every op reads.
KeySearchRows key_search_rows(const char* op, const at::Tensor& y, const std::optional<at::Tensor>& allowed_mask,
                              int64_t vocab_start, const std::optional<at::Tensor>& row_scales) {
  TORCH_CHECK(y.is_cuda() && y.scalar_type() == at::kFloat && y.dim() == 2 && y.stride(1) == 1, op,
              ": y must be a float32 [B, V] CUDA tensor with unit stride along V, got ", y.scalar_type(), " ",
              y.sizes(), " on ", y.device());
  TORCH_CHECK(y.size(1) <= kKeySearchMaxVocab, op, ": V must be at most ", kKeySearchMaxVocab, ", got ", y.size(1));
  TORCH_CHECK(vocab_start >= 0 && vocab_start + y.size(1) <= (int64_t{1} << 31), op,
              ": vocab_start + V must lie in [0, 2^31], got ", vocab_start, " + ", y.size(1));
  KeySearchRows rows;
  rows.y = y.const_data_ptr<float>();
  rows.row_stride = y.stride(0);
  rows.batch_size = y.size(0);
  rows.vocab_size = y.size(1);
  rows.vocab_start = vocab_start;
  rows.mask_words = (y.size(1) + 31) / 32;
  if (allowed_mask.has_value()) {
    const at::Tensor& m = *allowed_mask;
    TORCH_CHECK(m.scalar_type() == at::kInt && m.device() == y.device() && m.dim() == 2 &&
                    m.size(0) == y.size(0) && m.size(1) == rows.mask_words && m.is_contiguous(),
                op, ": allowed_mask must be a contiguous int32 [B, ceil(V / 32)] = [", y.size(0), ", ", rows.mask_words,
                "] tensor on y's device, got ", m.scalar_type(), " ", m.sizes(), " on ", m.device());
    rows.allowed_mask = reinterpret_cast<const uint32_t*>(m.const_data_ptr<int32_t>());
  }
  if (row_scales.has_value()) {
    const at::Tensor& s = *row_scales;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.device() == y.device() && s.dim() == 1 && s.size(0) == y.size(0) &&
                    s.is_contiguous(),
                op, ": row_scales must be a contiguous float32 [B] = [", y.size(0), "] tensor on y's device, got ",
                s.scalar_type(), " ", s.sizes(), " on ", s.device());
    rows.row_scales = s.const_data_ptr<float>();
  }
  return rows;
}

// A [B] tensor of `dtype` on y's device (contiguous), or absent where `required` is false.
template <typename T>
const T* row_array(const char* op, const char* name, const std::optional<at::Tensor>& t, const at::Tensor& y,
                   at::ScalarType dtype) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == dtype && t->device() == y.device() && t->dim() == 1 && t->size(0) == y.size(0) &&
                  t->is_contiguous(),
              op, ": ", name, " must be a contiguous ", dtype, " [B] = [", y.size(0), "] tensor on y's device, got ",
              t->scalar_type(), " ", t->sizes(), " on ", t->device());
  return t->const_data_ptr<T>();
}

at::Tensor first_order_keys_cuda(const at::Tensor& y, const std::optional<at::Tensor>& allowed_mask,
                                 int64_t vocab_start, const std::optional<at::Tensor>& row_scales) {
  constexpr const char* kOp = "flashsampling._first_order_keys";
  const c10::cuda::CUDAGuard guard(y.device());
  KeySearchRows const rows = key_search_rows(kOp, y, allowed_mask, vocab_start, row_scales);
  at::Tensor first = at::full({y.size(0)}, INT64_MAX, y.options().dtype(at::kLong));
  check_cuda_launch(launch_first_order_keys(rows, first.mutable_data_ptr<int64_t>(),
                                            device_info(y.get_device()).sm_count, c10::cuda::getCurrentCUDAStream()),
                    kOp);
  return first;
}

std::tuple<at::Tensor, at::Tensor> order_key_round_cuda(
    const at::Tensor& y, const std::optional<at::Tensor>& allowed_mask, int64_t vocab_start, int64_t shift,
    const at::Tensor& target, const std::optional<at::Tensor>& state, const std::optional<at::Tensor>& hist,
    const std::optional<at::Tensor>& limit, const std::optional<at::Tensor>& y0,
    const std::optional<at::Tensor>& min_ps, const std::optional<at::Tensor>& first,
    const std::optional<at::Tensor>& row_scales) {
  constexpr const char* kOp = "flashsampling._order_key_round";
  const c10::cuda::CUDAGuard guard(y.device());
  KeySearchRound round;
  round.rows = key_search_rows(kOp, y, allowed_mask, vocab_start, row_scales);
  const int64_t batch = y.size(0);
  TORCH_CHECK(shift == -kKeySearchDigitBits || (shift >= 0 && shift <= 56 && shift % kKeySearchDigitBits == 0), kOp,
              ": shift must be one of 56, 48, ..., 0 or -8 (the choice alone), got ", shift);
  TORCH_CHECK(state.has_value() == hist.has_value(), kOp, ": state and hist come together (absent: the first round)");
  bool const by_mass = target.scalar_type() == at::kDouble;
  if (by_mass) {
    round.top_ps = row_array<double>(kOp, "target", target, y, at::kDouble);
    TORCH_CHECK(y0.has_value(), kOp, ": a top_p search (float64 target) needs y0");
    round.y0 = row_array<float>(kOp, "y0", y0, y, at::kFloat);
    round.min_ps = row_array<double>(kOp, "min_ps", min_ps, y, at::kDouble);
    TORCH_CHECK(!min_ps.has_value() || first.has_value(), kOp, ": min_ps needs first");
    round.first = row_array<int64_t>(kOp, "first", first, y, at::kLong);
  } else {
    round.top_ks = row_array<int64_t>(kOp, "target", target, y, at::kLong);
    TORCH_CHECK(!min_ps.has_value(), kOp, ": min_ps filters top_p's masses (a float64 target)");
  }
  round.limit = row_array<int64_t>(kOp, "limit", limit, y, at::kLong);
  if (state.has_value()) {
    TORCH_CHECK(state->scalar_type() == at::kLong && state->device() == y.device() && state->is_contiguous() &&
                    state->sizes() == at::IntArrayRef({batch, kKeySearchStateWords}),
                kOp, ": state must be the previous round's int64 [B, ", kKeySearchStateWords, "], got ", state->sizes());
    TORCH_CHECK(hist->scalar_type() == at::kLong && hist->device() == y.device() && hist->is_contiguous() &&
                    hist->sizes() == at::IntArrayRef({batch, kKeySearchPlanes, kKeySearchBins}),
                kOp, ": hist must be the previous round's int64 [B, ", kKeySearchPlanes, ", ", kKeySearchBins, "], got ",
                hist->sizes());
    round.state_in = state->const_data_ptr<int64_t>();
    round.hist_in = hist->const_data_ptr<int64_t>();
  }
  round.shift = static_cast<int>(shift);
  at::Tensor state_out = at::empty({batch, kKeySearchStateWords}, y.options().dtype(at::kLong));
  round.state_out = state_out.mutable_data_ptr<int64_t>();
  at::Tensor hist_out = shift >= 0 ? at::zeros({batch, kKeySearchPlanes, kKeySearchBins}, y.options().dtype(at::kLong))
                                   : at::empty({0}, y.options().dtype(at::kLong));
  if (shift >= 0) round.hist_out = reinterpret_cast<unsigned long long*>(hist_out.mutable_data_ptr<int64_t>());
  check_cuda_launch(
      launch_key_search_round(round, device_info(y.get_device()).sm_count, c10::cuda::getCurrentCUDAStream()), kOp);
  return {state_out, hist_out};
}

at::Tensor order_key_cut_mask_cuda(const at::Tensor& y, const std::optional<at::Tensor>& allowed_mask,
                                   int64_t vocab_start, const at::Tensor& cut, const std::optional<at::Tensor>& first,
                                   const std::optional<at::Tensor>& y0, const std::optional<at::Tensor>& min_ps,
                                   const std::optional<at::Tensor>& row_scales) {
  constexpr const char* kOp = "flashsampling._order_key_cut_mask";
  const c10::cuda::CUDAGuard guard(y.device());
  KeyCutMask c;
  c.rows = key_search_rows(kOp, y, allowed_mask, vocab_start, row_scales);
  c.cut = row_array<int64_t>(kOp, "cut", cut, y, at::kLong);
  TORCH_CHECK(!min_ps.has_value() || (first.has_value() && y0.has_value()), kOp, ": min_ps needs first and y0");
  c.first = row_array<int64_t>(kOp, "first", first, y, at::kLong);
  c.y0 = row_array<float>(kOp, "y0", y0, y, at::kFloat);
  c.min_ps = row_array<double>(kOp, "min_ps", min_ps, y, at::kDouble);
  at::Tensor mask = at::empty({y.size(0), c.rows.mask_words}, y.options().dtype(at::kInt));
  c.mask = reinterpret_cast<uint32_t*>(mask.mutable_data_ptr<int32_t>());
  check_cuda_launch(launch_key_cut_mask(c, device_info(y.get_device()).sm_count, c10::cuda::getCurrentCUDAStream()),
                    kOp);
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CUDA, m) {
  m.impl("_first_order_keys", &first_order_keys_cuda);
  m.impl("_order_key_round", &order_key_round_cuda);
  m.impl("_order_key_cut_mask", &order_key_cut_mask_cuda);
}

}  // namespace flashsampling
