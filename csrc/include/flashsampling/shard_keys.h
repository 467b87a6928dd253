// Keys of the tensor-parallel exchange (flashsampling_cuda/distributed.py), for host and
// device: every rank turns its shard's (token, score) per (row, sample) into one int64 whose
// signed max over the ranks is the global winner under fs_candidate_better's order, so the
// ranks exchange one all-gather of keys and each takes the max.
//
//   key = ordered(score) * 2^32 + (2^31 - 1 - token)    token >= 0 (the op never reports a
//                                                         NaN score; -inf when no candidate)
//   key = INT64_MIN + 1    token -1: the shard's row has no candidate (all scores NaN)
//   key = INT64_MIN        token -2: the shard's mask allows nothing in the row
//
// ordered() maps fp32 bits to int32 monotonically (negative floats: magnitude bits flipped;
// -0 folded into +0 first, as the two compare equal).
#pragma once

#include <cstdint>

#include "flashsampling/philox_gumbel.h"

namespace flashsampling {

constexpr int64_t kShardKeyMaskEmpty = INT64_MIN;
constexpr int64_t kShardKeyNoCandidate = INT64_MIN + 1;

FS_HOST_DEVICE int64_t fs_shard_key(int64_t token, float score) {
  if (token < 0) return token == -1 ? kShardKeyNoCandidate : kShardKeyMaskEmpty;
  int32_t const bits = static_cast<int32_t>(fs_float_as_uint(fs_add(score, 0.0f)));
  int64_t const ordered = static_cast<int64_t>(bits ^ ((bits >> 31) & 0x7FFFFFFF));
  return ordered * (int64_t{1} << 32) + (int64_t{0x7FFFFFFF} - token);
}

// The token of a candidate key (not of the two sentinels).
FS_HOST_DEVICE int64_t fs_shard_key_token(int64_t key) { return int64_t{0x7FFFFFFF} - (key & 0xFFFFFFFFLL); }

// The exchange's result for one (row, sample): the best key over the ranks, the first rank
// holding it, and the token (-1 for no candidate, mask_empty_token where no shard's mask
// allows anything).
FS_HOST_DEVICE void fs_merge_shard_keys(const int64_t* keys, int64_t rank_stride, int64_t world,
                                        int64_t mask_empty_token, int64_t& best, int64_t& winner,
                                        int64_t& token) {
  best = keys[0];
  winner = 0;
  for (int64_t r = 1; r < world; ++r) {
    int64_t const key = keys[r * rank_stride];
    if (key > best) {
      best = key;
      winner = r;
    }
  }
  token = best == kShardKeyNoCandidate ? -1 : best == kShardKeyMaskEmpty ? mask_empty_token : fs_shard_key_token(best);
}

}  // namespace flashsampling
