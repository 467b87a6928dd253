// How the logits sampler's streaming kernels (csrc/kernels/streaming_rows.cu) split their rows into
// items: pure functions of the counts, shared by the host (the grid's and the workspace's sizes) and
// the device (each CTA's item), and answered on the CPU by the ops flashsampling::_streaming_chunks
// and _round_chunk_tokens (tests/test_streaming_chunks.py checks their invariants). Torch-free and
// CUDA-free.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#define FS_CHUNKS_FN __host__ __device__ inline
#else
#define FS_CHUNKS_FN inline
#endif

namespace flashsampling {

// streaming_sample_kernel's CTAs an SM (its __launch_bounds__: its registers).
constexpr int kStreamingCtasPerSm = 3;

// The streaming pass's top_p instance's items: about kStreamingWaves waves of its resident CTAs
// (kStreamingCtasPerSm an SM). Its rows can differ in work by far (LLM-like top_p rows: a few tokens
// within reach of the noise, or thousands), and smaller chunks spread a heavy quad over more CTAs:
// one wave made those slower (CHANGELOG). The min_p instance takes one wave: its flat rows do the
// same work in every chunk, so a last partial wave would cost a whole chunk's time more.
constexpr uint32_t kStreamingWaves = 2;
// Its chunks start on whole 256-token steps of its loops (and 16-byte boundaries of a stored row:
// the min_p pass's float4 loads).
constexpr uint32_t kStreamingChunkQuantum = 256;

// A top_p round's item is a chunk of a row, whole steps of the round's loop (streaming_rows.cu
// checks): kRoundChunkTokens in the verifying rounds (a step of four float4 loads a thread),
// kRoundDrawChunkTokens in the drawing rounds (a step of four tokens a thread, each a Philox block:
// their few rows spread over more CTAs, whose warps hide each other's dependent chains), sized on
// the device from the round's row count (round_chunk_tokens). An item's setup (its row's
// parameters, then the merge of its partial through a fence and a ticket) is a chain of memory
// round trips, so a row has at most round_chunks(vocab, step) chunks.
constexpr int64_t kRoundChunkTokens = 4096;
constexpr int64_t kRoundDrawChunkTokens = 1024;
constexpr uint32_t kRoundMostWaves = 4;
static_assert(kRoundChunkTokens % kRoundDrawChunkTokens == 0, "the workspace holds the drawing rounds' chunks");

// The most chunks a row can have in a round of `step`-token steps; the workspace's partials hold
// the drawing rounds' (kRoundDrawChunkTokens), the most.
FS_CHUNKS_FN int64_t round_chunks(int64_t vocab, int64_t step) { return (vocab + step - 1) / step; }

// A row's (or quad's) split into `chunks` chunks of `tokens` tokens (the last one shorter).
struct EvenChunks {
  uint32_t chunks, tokens;
};

// The split of `units` rows (or quads) of `vocab` tokens into up to `items` items: each unit in as
// many chunks as keep units * chunks within `items` (at least one, at most `most_chunks`), the
// tokens rounded up to a multiple of `quantum` (which only lowers the count). Equal chunks over
// whole waves of CTAs: a CTA that got two chunks where the others got one sets the launch's time.
FS_CHUNKS_FN EvenChunks even_chunks(uint32_t units, uint32_t vocab, uint32_t items, uint32_t most_chunks,
                                    uint32_t quantum) {
  uint32_t const per_unit = units < 1 ? items : items / units;
  uint32_t const wanted = per_unit < 1 ? 1 : per_unit > most_chunks ? most_chunks : per_unit;
  uint32_t const tokens = ((vocab + wanted - 1) / wanted + quantum - 1) / quantum * quantum;
  return {(vocab + tokens - 1) / tokens, tokens};
}

// The most chunks a quad can have in a streaming launch (one a kStreamingChunkQuantum step).
FS_CHUNKS_FN uint32_t streaming_steps(uint32_t vocab) {
  return (vocab + kStreamingChunkQuantum - 1) / kStreamingChunkQuantum;
}

// The chunks of a streaming launch. Its items are (listed quad, chunk) pairs: the listed quads are
// those with a streaming row, in batch order, and each has the same chunks (even_chunks over the
// waves' CTAs). The kernel sizes them on the device from the listed count, so that the few rows the
// fused truncation hands over (LLM-like top_p rows beyond 64) spread over the GPU as a whole
// batch's do. 32 bits: the divisions are the kernel's first steps.
FS_CHUNKS_FN uint32_t streaming_items_target(int sm_count, bool one_wave) {
  uint32_t const sms = sm_count < 1 ? 1 : static_cast<uint32_t>(sm_count);
  return kStreamingCtasPerSm * sms * (one_wave ? 1 : kStreamingWaves);
}
FS_CHUNKS_FN EvenChunks quad_chunks(uint32_t listed_quads, uint32_t vocab, int sm_count, bool one_wave) {
  return even_chunks(listed_quads, vocab, streaming_items_target(sm_count, one_wave), streaming_steps(vocab),
                     kStreamingChunkQuantum);
}

// The most items of a launch of `quads` quads, for any count of them listed: listed * chunks is at
// most the larger of streaming_items_target and listed; the grid has that many CTAs.
inline int64_t most_streaming_items(int64_t quads, int64_t vocab, int sm_count, bool one_wave) {
  int64_t const bound = std::max<int64_t>(streaming_items_target(sm_count, one_wave), quads);
  return std::min(bound, quads * int64_t{streaming_steps(static_cast<uint32_t>(vocab))});
}

// The items the workspace holds: either instance's, since a caller may size it before it knows
// which a launch takes.
inline int64_t workspace_streaming_items(int64_t quads, int64_t vocab, int sm_count) {
  return std::max(most_streaming_items(quads, vocab, sm_count, false),
                  most_streaming_items(quads, vocab, sm_count, true));
}

// A round's split of `r` rows of `v` tokens over `waves` waves of `c` CTAs (even_chunks, whole
// `step`-token steps) and its cost: a wave costs a chunk's tokens plus a step for the item's setup.
struct RoundSplit {
  uint32_t tokens, cost;
};
FS_CHUNKS_FN RoundSplit round_split(uint32_t r, uint32_t v, uint32_t c, uint32_t waves, uint32_t step) {
  EvenChunks const split = even_chunks(r, v, waves * c, static_cast<uint32_t>(round_chunks(v, step)), step);
  return {split.tokens, (r * split.chunks + c - 1) / c * (split.tokens + step)};
}

// A round's chunk for `rows` listed rows of `vocab` tokens over `ctas` CTAs, whole `step`-token
// steps (every thread alike): of the splits that fill one to kRoundMostWaves waves of the grid, the
// one whose waves cost the least (the first, fewest waves, of equals). 256 rows of 152K tokens on
// 528 CTAs split in two (one wave) rather than into 73728-token chunks (two and a sliver a row: two
// waves), and 200 rows into five (two waves) rather than two (one wave of 77824-token chunks).
// `vocab` below 2^22 (the logits sampler's). The round kernel takes the waves' splits in a warp's
// lanes side by side.
FS_CHUNKS_FN int64_t round_chunk_tokens(int64_t rows, int64_t vocab, int64_t ctas, int64_t step) {
  if (rows < 1 || rows >= ctas) return vocab;  // a row an item, or nothing to do
  uint32_t const r = static_cast<uint32_t>(rows), v = static_cast<uint32_t>(vocab), c = static_cast<uint32_t>(ctas);
  uint32_t const s = static_cast<uint32_t>(step);
  RoundSplit best = round_split(r, v, c, 1, s);
  for (uint32_t waves = 2; waves <= kRoundMostWaves; ++waves) {
    RoundSplit const split = round_split(r, v, c, waves, s);
    if (split.cost < best.cost) best = split;
  }
  return best.tokens;
}

}  // namespace flashsampling
