"""How the streaming kernels split their rows into items (csrc/include/flashsampling/streaming_chunks.h),
pure functions of the counts that the host (grid, workspace) and every CTA compute alike: checked on
the CPU through torch.ops.flashsampling._streaming_chunks and _round_chunk_tokens (no GPU).

The kernels rely on these invariants: a launch's items (listed quads x chunks) never exceed its grid
(most_streaming_items) and so its workspace; chunks start on 256-token steps (streaming pass) or
whole steps of the rounds' loops (4096 tokens verifying, 1024 drawing); a round's chunk count stays
within the workspace's round_chunks(vocab, 1024) partials a row; the chunks cover the row."""

import math

import pytest
import torch

import flashsampling_cuda  # noqa: F401  (registers the ops)

VOCABS = (1, 255, 256, 257, 4095, 4096, 4097, 9001, 32000, 128256, 151936, 229376, 1 << 22)
SM_COUNTS = (1, 7, 78, 132, 148, 213)


def streaming_chunks(listed, quads, vocab, sms, one_wave):
    return torch.ops.flashsampling._streaming_chunks(listed, quads, vocab, sms, one_wave)


def round_tokens(rows, vocab, ctas, step=4096):
    return torch.ops.flashsampling._round_chunk_tokens(rows, vocab, ctas, step)


@pytest.mark.parametrize("one_wave", [False, True])
@pytest.mark.parametrize("vocab", VOCABS)
def test_streaming_items_fit_the_grid_and_cover_the_row(vocab, one_wave):
    for sms in SM_COUNTS:
        target = 3 * sms * (1 if one_wave else 2)
        for quads in (1, 2, 3, 4, 16, 37, 64, 65, 200, 1024):
            grid = None
            for listed in sorted(n for n in {1, 2, 3, quads // 3, quads // 2, quads - 1, quads} if 1 <= n <= quads):
                chunks, tokens, most = streaming_chunks(listed, quads, vocab, sms, one_wave)
                grid = most if grid is None else grid
                assert most == grid  # the grid does not depend on how many quads are listed
                assert tokens % 256 == 0 and tokens >= 256
                assert chunks == math.ceil(vocab / tokens)  # the chunks cover the row, none empty
                assert listed * chunks <= grid
                assert listed * chunks <= max(target, listed)


def test_streaming_chunks_examples():
    # 256 flat rows (64 quads) on 132 SMs: two waves of three CTAs an SM, 12 chunks a quad.
    assert streaming_chunks(64, 64, 151936, 132, False)[:2] == (12, 12800)
    # 16 min_p rows (4 quads), one wave: 99 chunks of 1536 tokens, every CTA of the wave busy.
    assert streaming_chunks(4, 4, 151936, 132, True)[:2] == (99, 1536)
    # A few listed quads spread over the GPU as a whole batch would.
    chunks, tokens, _ = streaming_chunks(3, 64, 151936, 132, False)
    assert chunks * 3 <= 2 * 3 * 132 and tokens == 256 * math.ceil(151936 / (264 * 256))


@pytest.mark.parametrize("step", [4096, 1024], ids=["verifying", "drawing"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_round_chunks_are_whole_steps_within_the_workspace(vocab, step):
    most_chunks = math.ceil(vocab / step)  # the workspace holds ceil(vocab / 1024) a row
    for ctas in (1, 2, 38, 100, 528, 592, 1000):
        for rows in (0, 1, 2, 3, 7, 16, 26, 64, 100, 127, 128, 200, 263, 264, 300, 527, 528, 529, 1000):
            tokens = round_tokens(rows, vocab, ctas, step)
            chunks = math.ceil(vocab / tokens)
            if rows >= 1 and rows < ctas:
                assert tokens % step == 0
            else:
                assert tokens == vocab  # a row an item (or no row)
            assert 1 <= chunks <= most_chunks
            if 1 <= rows < ctas:
                assert rows * chunks <= 4 * ctas  # at most kRoundMostWaves waves


def test_round_chunks_examples():
    # 256 flat rows on 528 CTAs: two chunks a row in one wave, not 73728-token chunks (two waves).
    assert round_tokens(256, 151936, 528) == 77824
    # 200 rows: five chunks a row in two waves rather than two (one wave of 77824-token chunks).
    assert round_tokens(200, 151936, 528) == 32768
    # Few rows: whole steps, at most round_chunks(vocab, 4096) = 38 a row.
    assert round_tokens(16, 151936, 528) == 8192
    assert round_tokens(1, 151936, 528) == 4096
    # A drawing round's few rows: 1024-token chunks, 149 a row (three rows: 447 CTAs of 528 busy).
    assert round_tokens(3, 151936, 528, 1024) == 1024
    assert round_tokens(16, 151936, 528, 1024) == 5120


def test_bad_counts_name_the_argument():
    with pytest.raises(RuntimeError, match="listed_quads"):
        streaming_chunks(5, 4, 151936, 132, False)
    with pytest.raises(RuntimeError, match="vocab"):
        streaming_chunks(1, 1, 0, 132, False)
    with pytest.raises(RuntimeError, match="sm_count"):
        streaming_chunks(1, 1, 151936, 0, False)
    with pytest.raises(RuntimeError, match="rows"):
        round_tokens(-1, 151936, 528)
    with pytest.raises(RuntimeError, match="ctas"):
        round_tokens(1, 151936, 0)
    with pytest.raises(RuntimeError, match="step"):
        round_tokens(1, 151936, 528, 2048)
