"""The radix search of the global truncation across vocabulary shards
(flashsampling_cuda/shard_truncation.py), every shard in one process: the shards' survivors,
put back in global-id order, == the float64 reference ``survivor_mask`` of the whole rows,
for every form and order, over unequal shards out of vocabulary order, ties, masks, NaN and
infinite logits, per-row parameters with rows off; and the same on every split of the
vocabulary (the fixed-point masses' sums are exact in any order). The process-group runs of
it are tests/test_distributed.py's."""

from __future__ import annotations

import pytest
import torch

from flashsampling_cuda.shard_truncation import sharded_survivors
from flashsampling_cuda.truncation import Truncation, survivor_mask

VOCAB = 300
BATCH = 12


def _sum_over_shards(t: torch.Tensor, how: str) -> torch.Tensor:
    """The process group's all-reduce, every shard in dimension 0."""
    out = t.sum(0, keepdim=True) if how == "sum" else t.amin(0, keepdim=True)
    return out.expand_as(t)


def _shards(vocab: int, count: int, seed: int) -> list[tuple[int, int]]:
    """Unequal (start, size) shards tiling [0, vocab), one of size 1, out of vocabulary order."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randperm(vocab - 2, generator=g)[: count - 2].add(2).tolist()) | {1})[: count - 1]
    bounds = [0] + cuts + [vocab]
    shards = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1)]
    return [shards[i] for i in torch.randperm(len(shards), generator=g).tolist()]


def sharded(y, allowed, truncation, order, shards):
    """survivor mask [B, V] of the search over `shards`, padded to one width, in global-id order."""
    width = max(size for _, size in shards)
    batch = y.shape[0]
    ys = torch.full((len(shards), batch, width), torch.nan)
    kept = torch.zeros((len(shards), batch, width), dtype=torch.bool)
    ids = torch.zeros((len(shards), 1, width), dtype=torch.int64)
    for s, (start, size) in enumerate(shards):
        ys[s, :, :size] = y[:, start : start + size]
        kept[s, :, :size] = True if allowed is None else allowed[:, start : start + size]
        ids[s, 0, :size] = torch.arange(start, start + size)
    keep = sharded_survivors(ys, kept, ids, truncation, order, _sum_over_shards)
    out = torch.zeros_like(y, dtype=torch.bool)
    for s, (start, size) in enumerate(shards):
        out[:, start : start + size] = keep[s, :, :size]
    return out


def _logits(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(BATCH, VOCAB, generator=g)
    if kind == "peaked":  # a Zipf-like head over a Gaussian bulk
        y = torch.randn(BATCH, VOCAB, generator=g)
        head = torch.randint(0, VOCAB, (BATCH, 8), generator=g)
        return y.scatter_add(1, head, 12.0 - 1.5 * torch.arange(8.0).expand(BATCH, 8))
    # ties: small integers, many equal y; plus the special values
    y = torch.randint(-3, 4, (BATCH, VOCAB), generator=g).float() * 0.75
    y[0, 5:40] = -torch.inf
    y[1, :] = -torch.inf  # a row of -inf: the first token only where top_p / min_p are on
    y[2, 7] = torch.inf
    y[3, 3:9] = torch.nan
    y[4, :] = torch.nan
    return y


PER_ROW_K = torch.tensor([1, 0, 5, 60, -1, 3, 299, 300, 1000, 2, 17, 40])
PER_ROW_P = torch.tensor([0.9, 0.5, 1.0, 0.7, 0.95, 0.2, 0.0, 0.999, float("nan"), 0.3, 0.6, 0.05], dtype=torch.float64)
PER_ROW_MIN_P = torch.tensor([0.0, 0.1, 0.3, 0.5, 0.9, 1.0, 0.01, 0.05, 0.2, 0.0, 0.7, 0.02], dtype=torch.float64)
FORMS = {
    "top_k_host": Truncation(20, None, None),
    "top_k_rows": Truncation(PER_ROW_K, None, None),
    "top_p_alone": Truncation(None, 0.9, None),
    "top_p_rows": Truncation(None, PER_ROW_P, None),
    "min_p_rows": Truncation(None, None, PER_ROW_MIN_P),
    "top_k_rows_top_p_rows": Truncation(PER_ROW_K, PER_ROW_P, None),
    "top_k_top_p_min_p": Truncation(50, 0.8, 0.05),
    "all_rows": Truncation(PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P),
    "top_k_above_vocab": Truncation(500, 0.5, None),
}


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("order", ["top_k_first", "min_p_first", "joint"])
def test_shards_keep_the_reference_survivors(kind, form, order):
    truncation = FORMS[form]
    for seed, masked in ((1, False), (2, True)):
        y = _logits(kind, seed)
        allowed = None
        if masked:
            allowed = torch.rand(BATCH, VOCAB, generator=torch.Generator().manual_seed(seed)) < 0.6
            allowed[5] = False  # a row that allows nothing
            allowed[6] = False
            allowed[6, 123] = True  # one token
        expected = survivor_mask(y, allowed, truncation, order)
        for count in (1, 2, 5):
            got = sharded(y, allowed, truncation, order, _shards(VOCAB, count, seed=10 * seed + count))
            bad = (got != expected).any(dim=1).nonzero().flatten().tolist()
            assert not bad, f"{count} shards: rows {bad} differ (got {got[bad].sum(1).tolist()} survivors, " \
                            f"expected {expected[bad].sum(1).tolist()})"


def test_every_row_keeps_its_first_token():
    y = _logits("flat", 3)
    keep = sharded(y, None, Truncation(None, torch.zeros(BATCH, dtype=torch.float64), None), "top_k_first",
                   _shards(VOCAB, 4, 3))
    assert keep.sum(dim=1).eq(1).all()
    assert (keep.float().argmax(dim=1) == y.argmax(dim=1)).all()


@pytest.mark.requires_cuda
@pytest.mark.parametrize("vocab", [300, 10007])
@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
@pytest.mark.parametrize("order", ["top_k_first", "min_p_first", "joint"])
def test_kernels_keep_the_survivors_of_the_torch_search(vocab, kind, order):
    """survivor_bitmask (csrc/kernels/key_search.cu: a kernel a round) == sharded_survivors's
    torch ops on the same CUDA rows (one shard, vocab_start > 0, a prime V over several chunks) ==
    the float64 reference, for every form, with and without a mask."""
    from flashsampling_cuda.masks import pack_allowed_mask, unpack_allowed_mask
    from flashsampling_cuda.shard_truncation import survivor_bitmask

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(vocab)
    y = torch.cat([_logits(kind, seed) for seed in range(1, 1 + -(-vocab // VOCAB))], dim=1)[:, :vocab]
    if kind == "peaked":  # one head a row over the wider row
        y = torch.randn(BATCH, vocab, generator=g).scatter_add(
            1, torch.randint(0, vocab, (BATCH, 8), generator=g), 12.0 - 1.5 * torch.arange(8.0).expand(BATCH, 8))
    allowed = torch.rand(BATCH, vocab, generator=g) < 0.6
    allowed[5] = False
    start = 1000
    identity = lambda t, how: t  # noqa: E731
    for masked in (False, True):
        kept = allowed if masked else None
        mask = pack_allowed_mask(kept).to(device) if masked else None
        for name, truncation in FORMS.items():
            truncation = Truncation(*(v.to(device) if isinstance(v, torch.Tensor) else v for v in truncation))
            got = unpack_allowed_mask(survivor_bitmask(y.to(device), mask, start, truncation, order, identity),
                                      vocab).cpu()
            ids = torch.arange(start, start + vocab, device=device)
            torch_ops = sharded_survivors(y.to(device)[None], None if kept is None else kept.to(device)[None], ids,
                                          truncation, order, identity)[0].cpu()
            reference = survivor_mask(y, kept, Truncation(*(v.cpu() if isinstance(v, torch.Tensor) else v
                                                            for v in truncation)), order)
            for label, expected in (("torch ops", torch_ops), ("reference", reference)):
                bad = (got != expected).any(dim=1).nonzero().flatten().tolist()
                assert not bad, f"{name}, masked={masked}: rows {bad} differ from the {label} " \
                                f"({got[bad].sum(1).tolist()} vs {expected[bad].sum(1).tolist()} survivors)"


@pytest.mark.requires_cuda
@pytest.mark.parametrize("vocab", [60000, 60001])
def test_kernels_on_many_rows_keep_the_survivors_of_the_torch_search(vocab):
    """Enough rows that a CTA takes several steps of the row (key_search.cu: pass_launch), with
    16-byte loads (V % 4 == 0) and without; flat and peaked rows side by side, so that some rows'
    cuts are complete after a few rounds and others (ties) need every round."""
    from flashsampling_cuda.masks import unpack_allowed_mask
    from flashsampling_cuda.shard_truncation import survivor_bitmask

    device = torch.device("cuda")
    batch = 600
    g = torch.Generator(device=device).manual_seed(vocab)
    y = torch.randn(batch, vocab, generator=g, device=device)
    y[1::3] = y[1::3].round()  # ties
    y[2::3, :16] += 14.0 - 1.5 * torch.arange(16.0, device=device)  # peaked
    rows = lambda values: torch.tensor(values, device=device).repeat(batch // len(values))  # noqa: E731
    identity = lambda t, how: t  # noqa: E731
    ids = torch.arange(3, 3 + vocab, device=device)
    for truncation in (Truncation(rows([20, 1, 700, 0]), None, None), Truncation(None, rows([0.9, 0.5, 0.99]), None),
                       Truncation(rows([50, 2000]), rows([0.95, 0.8]), 0.01)):
        got = unpack_allowed_mask(survivor_bitmask(y, None, 3, truncation, "top_k_first", identity), vocab)
        expected = sharded_survivors(y[None], None, ids, truncation, "top_k_first", identity)[0]
        bad = (got != expected).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"rows {bad[:8]} differ ({got[bad[:8]].sum(1).tolist()} vs {expected[bad[:8]].sum(1).tolist()})"


@pytest.mark.requires_cuda
@pytest.mark.parametrize("order", ["top_k_first", "min_p_first", "joint"])
def test_kernels_scaling_x_as_they_read_equal_the_search_over_y(order):
    """With row_scales the kernels read x and take y = fl32(x * row_scales[b]) (the tensor-parallel
    sample and sample_without_replacement no longer write y): the same bitmask as the search over
    scaled_logits' y, per-row temperatures with a greedy row (scale 1), NaN and infinite logits,
    products that overflow, and a mask."""
    from flashsampling_cuda.masks import pack_allowed_mask
    from flashsampling_cuda.shard_truncation import survivor_bitmask
    from flashsampling_cuda.truncation import scaled_logits, temperature_scales

    device = torch.device("cuda")
    batch, vocab = 12, 5003
    g = torch.Generator(device=device).manual_seed(7)
    x = 3.0 * torch.randn(batch, vocab, generator=g, device=device)
    x[1::4, :8] += 20.0  # peaked
    x[2::4] = x[2::4].round()  # ties
    x[0, 5], x[3, 7], x[4, 9] = float("nan"), float("inf"), -float("inf")
    # row 7: fl32(1 / T) = 1e38, so most of its x * scale overflow to +-inf in both
    temperatures = torch.tensor([0.7, 1.3, 0.0, 0.55, 1.0, 0.9, 2.0, 1e-38, 0.61, 1.7, 0.8, 1.1], device=device)
    mask = pack_allowed_mask(torch.rand(batch, vocab, generator=g, device=device) < 0.7)
    rows = lambda values: torch.tensor(values, device=device).repeat(batch // len(values))  # noqa: E731
    identity = lambda t, how: t  # noqa: E731
    for scalar, temps in ((0.8, None), (1.0, temperatures)):
        y = scaled_logits(x, scalar, temps)
        scales = temperature_scales(batch, scalar, temps, device)
        for truncation in (Truncation(rows([20, 0, 700]), None, None), Truncation(None, rows([0.9, 0.5, 0.99]), None),
                           Truncation(rows([50, 2000]), rows([0.95, 0.8]), 0.01), Truncation(None, None, 0.05)):
            for allowed in (None, mask):
                expected = survivor_bitmask(y, allowed, 3, truncation, order, identity)
                got = survivor_bitmask(x, allowed, 3, truncation, order, identity, scales)
                assert torch.equal(got, expected), (scalar, truncation, allowed is None)


@pytest.mark.requires_cuda
def test_opcheck_key_search_ops():
    """The three internal ops' schemas, fake kernels and dispatch (torch.compile traces them)."""
    device = torch.device("cuda")
    ops = torch.ops.flashsampling
    y = torch.randn(5, 5003, device=device)
    mask = torch.randint(-2**31, 2**31 - 1, (5, 157), dtype=torch.int32, device=device)
    first = ops._first_order_keys(y, mask, 7)
    torch.library.opcheck(ops._first_order_keys.default, (y, mask, 7))
    k = torch.tensor([1, 5, 300, 5003, 9999], device=device)
    state, hist = ops._order_key_round(y, mask, 7, 56, k, None, None)
    torch.library.opcheck(ops._order_key_round.default, (y, mask, 7, 56, k, None, None))
    torch.library.opcheck(ops._order_key_round.default, (y, mask, 7, 48, k, state, hist))
    top_p = torch.full((5,), 0.9, dtype=torch.float64, device=device)
    y0 = y.amax(dim=1)
    torch.library.opcheck(ops._order_key_round.default, (y, None, 7, 56, top_p, None, None),
                          dict(y0=y0, min_ps=top_p / 10, first=first))
    torch.library.opcheck(ops._order_key_round.default, (y, None, 7, -8, k, state, hist))
    torch.library.opcheck(ops._order_key_cut_mask.default, (y, mask, 7, first + 2**40, first, y0, None))
    torch.library.opcheck(ops._order_key_cut_mask.default, (y, mask, 7, first + 2**40))
    scales = torch.full((5,), 1.25, device=device)
    torch.library.opcheck(ops._first_order_keys.default, (y, mask, 7), dict(row_scales=scales))
    torch.library.opcheck(ops._order_key_round.default, (y, mask, 7, 56, k, None, None), dict(row_scales=scales))
    torch.library.opcheck(ops._order_key_cut_mask.default, (y, mask, 7, first + 2**40), dict(row_scales=scales))
    with pytest.raises(RuntimeError, match=r"_first_order_keys: row_scales must be a contiguous float32 \[B\]"):
        ops._first_order_keys(y, mask, 7, row_scales=scales.double())
    with pytest.raises(RuntimeError, match=r"_order_key_round: shift must be one of 56, 48"):
        ops._order_key_round(y, mask, 7, 50, k, None, None)
    with pytest.raises(RuntimeError, match=r"_first_order_keys: allowed_mask must be a contiguous int32"):
        ops._first_order_keys(y, mask[:, :10], 7)
    with pytest.raises(RuntimeError, match=r"_order_key_cut_mask: min_ps needs first and y0"):
        ops._order_key_cut_mask(y, mask, 7, first, min_ps=top_p / 10)
