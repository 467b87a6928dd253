"""A few odd shapes for compute-sanitizer (memcheck, racecheck) on the CUDA sampler:
partial vocabulary tiles, a prime V, B not a multiple of any N tile, B > 256, fp16; each
shape plain (one sample: the plain kernels of every N bucket; then greedy), with num_samples = 2 (two
GEMM column blocks: the controls kernels, on epilogue warpgroups beyond 16 columns), with the
common controls (per-row temperatures with greedy rows, logit bias, bitmask, logprobs: their own
kernels, on epilogue warpgroups beyond 16 columns; B = 17 the 32-wide tile) and with every control on (per-row temperatures, logit bias, sparse bias,
bitmask, per-row seeds, vocab_start, logprobs). B = 200, V = 151937 gives the epilogue-warpgroup
kernels many tiles per SM, so their exact skip (global floors, atomics) runs too; B = 100,
V = 32000 (a multiple of 4) the kernels' four-token loads and the min_p rows' one-wave grid; B = 144 the
plain loop's three 64-wide column tiles (hidden rows padded to 192); B = 48 the fused pass's 33-64
columns (the epilogue-warpgroup kernel's 64-wide top-k scan; at this D top_p alone without the tile
winners, its rows streamed). Each shape also
takes the logits path of truncation (sample_from_logits.cu: clusters of 8, 4 and 2 CTAs a row,
several rows per cluster at B = 257; one sample of top_p / min_p rows: its winner-first rows) and, on sm90 where V suits it, the fused pass with every form,
with per-row top_k / top_p / min_p, a mask and logprobs, and with one sample (the top_p rounds;
top_p alone: the tile winners; at a host temperature, plain sampling's pass storing the logits (up
to 32 rows on CUTLASS's narrow plain tile), on flat and peaked rows, and min_p alone's up to 128
rows); and top-N logprobs with ranks (the
top-N kernel's split passes and workspace; where the fused pass suits the shape, its route too); the soft-cap, scale and penalties alone and with
per-row temperatures; the truncation cut's key search (shard_truncation.py's kernels) in every order,
the logits sampler's streaming kernels over a sparse mask, and sample_without_replacement on the
search (its kernels scaling x as they read it). Arguments: the batch sizes of the shapes to run (default: all).
"""

import sys

import torch

import flashsampling_cuda
from flashsampling_cuda.masks import pack_allowed_mask
from flashsampling_cuda.shard_truncation import survivor_bitmask
from flashsampling_cuda.truncation import Truncation

SHAPES = [  # (B, V, D, dtype)
    (1, 1000, 64, torch.bfloat16),
    (3, 1009, 72, torch.float16),
    (17, 32003, 136, torch.bfloat16),
    (257, 4099, 64, torch.bfloat16),
    (65, 129, 2880, torch.float16),
    (200, 151937, 64, torch.bfloat16),
    (100, 32000, 128, torch.bfloat16),  # V % 4 == 0: the four-token loads (stop rows, stored rows' rounds)
    (144, 9001, 96, torch.bfloat16),  # plain, greedy, soft-capped: three 64-wide column tiles, padded
    (48, 32003, 136, torch.bfloat16),  # the top-k pass's 64-wide epilogue-warpgroup scan; top_p alone streamed (D <= 3072)
]

# Optional arguments: the batch sizes of the shapes to run (all by default).
ONLY = {int(b) for b in sys.argv[1:]}

for batch, vocab, dim, dtype in SHAPES:
    if ONLY and batch not in ONLY:
        continue
    hidden = torch.randn(batch, dim, device="cuda", dtype=dtype)
    weight = torch.randn(vocab, dim, device="cuda", dtype=dtype)
    tokens = flashsampling_cuda.sample(hidden, weight, seed=7)
    torch.cuda.synchronize()
    assert tokens.shape == (batch, 1) and int(tokens.min()) >= 0 and int(tokens.max()) < vocab, (batch, vocab)
    tokens = flashsampling_cuda.sample(hidden, weight, temperature=0.0)  # greedy: the skip too
    torch.cuda.synchronize()
    assert tokens.shape == (batch, 1) and int(tokens.min()) >= 0 and int(tokens.max()) < vocab, (batch, vocab)
    tokens = flashsampling_cuda.sample(hidden, weight, seed=7, num_samples=2)
    torch.cuda.synchronize()
    assert tokens.shape == (batch, 2) and int(tokens.min()) >= 0 and int(tokens.max()) < vocab, (batch, vocab)

    allowed = torch.rand(batch, vocab, device="cuda") < 0.5
    allowed[:, 0] = True
    temperatures = torch.rand(batch, device="cuda") + 0.1
    temperatures[::3] = 0.0
    out = flashsampling_cuda.sample(hidden, weight, temperature=temperatures, seed=7,
                                    logit_bias=torch.randn(vocab, device="cuda"), allowed_mask=allowed,
                                    return_logprobs=True)
    torch.cuda.synchronize()
    assert out.tokens.shape == (batch, 1) and bool(allowed.gather(1, out.tokens).all())
    assert torch.isfinite(out.logsumexp).all()
    ids = torch.randint(100, 100 + vocab, (batch, 5), device="cuda")
    out = flashsampling_cuda.sample(
        hidden, weight, temperature=torch.rand(batch, device="cuda") + 0.1, num_samples=3,
        seed=torch.arange(batch, device="cuda"), offset=torch.arange(batch, device="cuda"),
        logit_bias=torch.randn(vocab, device="cuda"), sparse_logit_bias=(ids, torch.randn(batch, 5, device="cuda")),
        allowed_mask=allowed, vocab_start=100, return_logprobs=True)
    torch.cuda.synchronize()
    assert out.tokens.shape == (batch, 3) and int(out.tokens.min()) >= 100 and int(out.tokens.max()) < 100 + vocab
    assert torch.isfinite(out.logsumexp).all()
    print(f"ok B={batch} V={vocab} D={dim} {dtype}")
    # The logit transforms alone (beyond 64 rows the plain epilogue-warpgroup loop) and with per-row
    # temperatures (the controls' loops), penalties on rows that only lower logits and on rows
    # that may raise them (r < 1): the rank-bitmap kernel's shared-memory scan too.
    prompt = torch.randint(0, vocab, (batch, 40), device="cuda")
    state = flashsampling_cuda.PenaltyState(prompt, torch.randint(0, min(vocab, 30), (batch, 20), device="cuda"))
    repetition = torch.where(torch.arange(batch, device="cuda") % 3 == 0, 0.8, 1.2)
    for temperature in (0.9, temperatures):
        tokens = flashsampling_cuda.sample(hidden, weight, temperature=temperature, seed=7, logit_softcap=5.0,
                                           logit_scale=0.5, repetition_penalty=repetition, frequency_penalty=0.3,
                                           presence_penalty=0.2, penalty_state=state)
        torch.cuda.synchronize()
        assert tokens.shape == (batch, 1) and int(tokens.min()) >= 0 and int(tokens.max()) < vocab, (batch, vocab)
    print(f"ok B={batch} V={vocab} D={dim} {dtype} (soft-cap, scale, penalties)")
    top_k = torch.randint(-1, 300, (batch,), device="cuda")
    top_p = torch.rand(batch, device="cuda")
    min_p = torch.rand(batch, device="cuda") * 0.2
    out = flashsampling_cuda.sample(hidden, weight, temperature=temperatures, seed=7, num_samples=2, top_k=top_k,
                                    top_p=top_p, min_p=min_p, allowed_mask=allowed, return_logprobs=True,
                                    truncation_path="logits")
    torch.cuda.synchronize()
    assert out.tokens.shape == (batch, 2) and bool(allowed.gather(1, out.tokens).all())
    assert torch.isfinite(out.logsumexp).all()
    print(f"ok B={batch} V={vocab} D={dim} {dtype} (truncation, logits path)")
    for truncation in (dict(top_p=top_p), dict(top_p=top_p, min_p=min_p), dict(min_p=min_p)):
        # One sample without logprobs: the logits kernel's winner-first rows.
        out = flashsampling_cuda.sample(hidden, weight, temperature=temperatures, seed=7, allowed_mask=allowed,
                                        truncation_path="logits", **truncation)
        torch.cuda.synchronize()
        assert bool(allowed.gather(1, out.view(batch, -1)).all())
    print(f"ok B={batch} V={vocab} D={dim} {dtype} (truncation, logits path, winner first)")
    # The truncation cut's radix search (key_search.cu: first keys, top_k's and top_p's rounds with
    # the min_p filter and the universe limit, the cut mask), then sample_without_replacement on it.
    y = torch.randn(batch, vocab, device="cuda")
    for order in ("top_k_first", "min_p_first", "joint"):
        survivor_bitmask(y, pack_allowed_mask(allowed), 5, Truncation(top_k, top_p, min_p), order, lambda t, how: t)
    # The logits sampler's streaming kernels over a sparse mask (the tensor-parallel survivors'
    # shape): a warp's step whose mask words allow nothing in its quad is skipped.
    sparse = torch.rand(batch, vocab, device="cuda") < 0.003
    sparse[:, -1] = True
    tokens = flashsampling_cuda.sample_from_logits(y, temperature=temperatures, seed=7, allowed_mask=sparse,
                                                   num_samples=2)
    torch.cuda.synchronize()
    assert bool(sparse.gather(1, tokens).all())
    out = flashsampling_cuda.sample_without_replacement(hidden, weight, 2, temperature=temperatures, seed=7,
                                                        top_k=top_k, top_p=top_p, min_p=min_p, allowed_mask=allowed,
                                                        empty_mask_token=-1)
    torch.cuda.synchronize()
    print(f"ok B={batch} V={vocab} D={dim} {dtype} (truncation's key search, without replacement)")
    # Top-N logprobs with the sampled tokens' ranks: the top-N kernel's split passes, workspace and finish.
    out = flashsampling_cuda.sample(hidden, weight, temperature=temperatures, seed=7, num_samples=2,
                                    allowed_mask=allowed, return_logprobs=True, top_logprobs=min(20, vocab))
    torch.cuda.synchronize()
    assert bool((out.ranks >= 1).all()) and bool(allowed.gather(1, out.top_ids.clamp(0, vocab - 1)).any(1).all())
    print(f"ok B={batch} V={vocab} D={dim} {dtype} (top-N logprobs)")
    # Several samples alone (with B % 4 == 0 beyond 64 columns: the plain epilogue-warpgroup loop).
    tokens = flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=7, num_samples=3)
    torch.cuda.synchronize()
    assert tokens.shape == (batch, 3) and bool((tokens >= 0).all())
    print(f"ok B={batch} V={vocab} D={dim} {dtype} (several samples alone)")
    # One-hot speculative verification (fused route): _sample_positions over the B * n + B rows
    # (several samples' layout), the acceptance walk, n = 3; then sampled drafts (the logits route).
    positions = 4
    spec_hidden = hidden[: max(1, batch // 4)].repeat_interleave(positions, 0)[: max(1, batch // 4) * positions]
    spec_hidden = spec_hidden.view(-1, positions, dim)
    drafts = torch.randint(0, vocab, (spec_hidden.shape[0], positions - 1), device="cuda")
    out = flashsampling_cuda.speculative_sample(spec_hidden, weight, drafts, temperature=temperatures[: spec_hidden.shape[0]],
                                                seed=7, allowed_mask=allowed[: spec_hidden.shape[0]],
                                                return_logprobs=True)
    torch.cuda.synchronize()
    assert bool((out.num_accepted >= 0).all()) and bool((out.num_accepted < positions).all())
    print(f"ok B={batch} V={vocab} D={dim} {dtype} (speculative, one-hot, fused route)")
    q = torch.softmax(torch.randn(spec_hidden.shape[0], positions - 1, vocab, device="cuda"), dim=2)
    out = flashsampling_cuda.speculative_sample(spec_hidden, weight, drafts, q, temperature=0.8, seed=7,
                                                return_logprobs=True)
    torch.cuda.synchronize()
    assert bool((out.num_accepted >= 0).all()) and bool((out.num_accepted < positions).all())
    print(f"ok B={batch} V={vocab} D={dim} {dtype} (speculative, sampled drafts)")
    if 4096 <= vocab <= 229376 and torch.cuda.get_device_capability() == (9, 0):
        # The fused pass with every form: stage 2's rows, its row list, the stored logits and the
        # logits kernel's two launches over the rows it leaves (per-row k up to 300: both kinds).
        # Per-row k up to 1100 without top_p, a host k = 1000 with min_p and a host k = 300 with top_p:
        # stage 2's selection in shared memory, its repair rounds and its sort (per-row k above 64:
        # the logits kernel).
        large_k = torch.randint(-1, 1100, (batch,), device="cuda")
        for truncation in (dict(top_k=top_k, top_p=top_p, min_p=min_p), dict(top_p=top_p), dict(min_p=min_p),
                           dict(top_k=large_k), dict(top_k=1000, min_p=min_p), dict(top_k=300, top_p=top_p, min_p=min_p)):
            out = flashsampling_cuda.sample(hidden, weight, temperature=temperatures, seed=7, num_samples=2,
                                            allowed_mask=allowed, return_logprobs=True,
                                            truncation_path="fused_top_k", **truncation)
            torch.cuda.synchronize()
            assert out.tokens.shape == (batch, 2) and bool(allowed.gather(1, out.tokens).all())
        # One sample without log-probabilities: top_p rows handed on to the rounds (with min_p after
        # the streaming pass; top_p alone at the batch-wide seed from the GEMM's tile winners up to 32
        # rows, and 33-64 rows beyond D = 3072, the rows without a cut decided in stage 2; else streamed).
        for truncation in (dict(top_p=top_p), dict(top_p=top_p, min_p=min_p)):
            tokens = flashsampling_cuda.sample(hidden, weight, temperature=temperatures, seed=7, allowed_mask=allowed,
                                               truncation_path="fused_top_k", **truncation)
            torch.cuda.synchronize()
            assert bool(allowed.gather(1, tokens.view(batch, 1)).all())
        # top_p alone at a host temperature without a mask: plain sampling's pass (up to 32 rows
        # CUTLASS's narrow plain tile), which stores the logits and each tile's largest, then the
        # rounds (top_p_on_plain_pass, narrow_plain_pass).
        tokens = flashsampling_cuda.sample(hidden, weight, temperature=0.9, seed=7, top_p=top_p,
                                           truncation_path="fused_top_k")
        torch.cuda.synchronize()
        assert bool(((tokens >= 0) & (tokens < vocab)).all())
        # The same on peaked rows (each a weight row, scaled), whose winners mostly lead their rows:
        # the plain pass's reduction keeps them (winner_leads_row); and min_p alone without
        # log-probabilities, which takes the plain pass up to 128 rows (at 33-64 rows the filtered
        # tile winners: on peaked rows the reduction reads the tiles whose failing candidate beats
        # the surviving ones).
        peaked = weight[torch.arange(batch, device="cuda") * 7 % vocab] * 4
        for inputs, truncation in ((peaked, dict(top_p=top_p)), (hidden, dict(min_p=min_p)),
                                   (peaked, dict(min_p=min_p))):
            tokens = flashsampling_cuda.sample(inputs, weight, temperature=0.9, seed=7, truncation_path="fused_top_k",
                                               **truncation)
            torch.cuda.synchronize()
            assert bool(((tokens >= 0) & (tokens < vocab)).all())
        # min_p alone without a mask: the streamed rows' quads take the sparse pass (float4 loads).
        out = flashsampling_cuda.sample(hidden, weight, temperature=0.9, seed=7, min_p=min_p, return_logprobs=True,
                                        truncation_path="fused_top_k")
        torch.cuda.synchronize()
        assert bool(((out.tokens >= 0) & (out.tokens < vocab)).all())
        print(f"ok B={batch} V={vocab} D={dim} {dtype} (truncation, fused path)")
        if batch <= 64:
            # Top-N logprobs on the fused route: stage 2's rows, the logits sampler's and the top-N
            # kernels over what stage 2 leaves (N = 64: every row's top N; flat rows: the ranks),
            # processed and raw.
            for top_n, mode in ((5, "processed"), (64, "processed"), (5, "raw"), (64, "raw")):
                out = flashsampling_cuda.sample(hidden, weight, temperature=temperatures, seed=7,
                                                return_logprobs=True, top_logprobs=top_n, logprobs_mode=mode,
                                                token_ids=torch.zeros(batch, 2, dtype=torch.int64, device="cuda"))
                torch.cuda.synchronize()
                assert bool((out.ranks >= 1).all()) and out.top_ids.shape == (batch, top_n)
            print(f"ok B={batch} V={vocab} D={dim} {dtype} (top-N logprobs, fused route)")
