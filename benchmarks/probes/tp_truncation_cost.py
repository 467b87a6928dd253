"""What the tensor-parallel sample's truncation costs on one GPU, and what
sample_without_replacement costs (probe, not a benchmark: one GPU cannot show the exchange).

A one-rank NCCL group (its all-reduces run as in a larger group): ``distributed.sample`` with each
truncation form (the shard's logits once, the radix search of flashsampling_cuda/shard_truncation.py,
then the logits sampler) against the single-process ``sample`` with the same form (the fused pass),
plain ``sample``, and what the path did before the search (:func:`before_this_change`); and
``sample_without_replacement`` (k = 4, top_p = 0.9) against its previous form and ``k`` plain samples. Each
call is captured in a CUDA graph and timed by CUDA events over replays (device time), median of
``--runs``; prints a table and writes JSON lines with --out.

    python benchmarks/probes/tp_truncation_cost.py [--shapes 4096x151936] [--batches 1,16,64,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import flashsampling_cuda as fs
from flashsampling_cuda import distributed as tp
from flashsampling_cuda.masks import pack_allowed_mask
from flashsampling_cuda.shard_truncation import survivor_bitmask
from flashsampling_cuda.problems import hidden_states, lm_head_weight
from flashsampling_cuda.truncation import materialized_logits, parse_truncation, scaled_logits, survivor_mask


def before_this_change(hidden, weight, common, form, samples: int = 1):
    """What the tensor-parallel truncation (samples = 1) and sample_without_replacement (samples =
    k) did on one GPU before the key search: the logits' matmul, the float64 survivors
    (survivor_mask: a sort of every row), then `samples` fused passes with them as the mask."""
    truncation = parse_truncation(form.get("top_k"), form.get("top_p"), form.get("min_p"), hidden)
    y = scaled_logits(materialized_logits(hidden, weight), common["temperature"], None)
    mask = pack_allowed_mask(survivor_mask(y, None, truncation))
    return [fs.sample(hidden, weight, **common, allowed_mask=mask, empty_mask_token=-1) for _ in range(samples)]


def graph_time_us(fn, runs: int, replays: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(times)


def forms(batch: int, device) -> dict:
    rows = lambda value: torch.full((batch,), value, device=device)  # noqa: E731
    return {
        "p0.9 [B]": dict(top_p=rows(0.9)),
        "k20 [B]": dict(top_k=rows(20)),
        "min_p0.05": dict(min_p=0.05),
        "k50,p0.9 [B]": dict(top_k=rows(50), top_p=rows(0.9)),
        "k50,p0.9 host": dict(top_k=50, top_p=0.9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4096x151936")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--regimes", default="flat,llm")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", torch.cuda.current_device()))
    records = []
    print(f"{'D':>5} {'V':>7} {'regime':>6} {'B':>4} {'form':>14} {'tp us':>8} {'before us':>9} {'single us':>9} "
          f"{'plain us':>8} {'tp/single':>9} {'search us':>9}")
    for shape in args.shapes.split(","):
        dim, vocab = (int(v) for v in shape.split("x"))
        weight = lm_head_weight(vocab, dim, device=device)
        for regime in args.regimes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                hidden = hidden_states(weight, batch, regime)
                seed, offset = torch.tensor(1, device=device), torch.tensor(0, device=device)
                common = dict(temperature=0.8, seed=seed, offset=offset)
                plain = graph_time_us(lambda: fs.sample(hidden, weight, **common), args.runs, args.replays)
                for name, form in forms(batch, device).items():
                    ours = graph_time_us(lambda: tp.sample(hidden, weight, vocab_start=0, **common, **form),
                                         args.runs, args.replays)
                    single = graph_time_us(lambda: fs.sample(hidden, weight, **common, **form), args.runs,
                                           args.replays)
                    before = graph_time_us(lambda: before_this_change(hidden, weight, common, form), args.runs,
                                           args.replays)
                    y = scaled_logits(materialized_logits(hidden, weight), common["temperature"], None)
                    truncation = parse_truncation(form.get("top_k"), form.get("top_p"), form.get("min_p"), hidden)
                    search = graph_time_us(lambda: survivor_bitmask(y, None, 0, truncation, "top_k_first",
                                                                    lambda t, how: t), args.runs, args.replays)
                    same = torch.equal(tp.sample(hidden, weight, vocab_start=0, **common, **form),
                                       fs.sample(hidden, weight, **common, **form))
                    record = dict(D=dim, V=vocab, regime=regime, B=batch, form=name, tp_us=ours, before_us=before,
                                  single_us=single, plain_us=plain, search_us=search, same_tokens=same)
                    records.append(record)
                    print(f"{dim:>5} {vocab:>7} {regime:>6} {batch:>4} {name:>14} {ours:8.1f} {before:9.1f} "
                          f"{single:9.1f} {plain:8.1f} {ours / single:9.2f} {search:9.1f}"
                          f"{'' if same else '  (tokens differ: near ties?)'}")
                for k in (4,):
                    without = graph_time_us(lambda: fs.sample_without_replacement(
                        hidden, weight, k, **common, top_p=0.9, empty_mask_token=-1), args.runs, args.replays)
                    before = graph_time_us(lambda: before_this_change(hidden, weight, common, dict(top_p=0.9), k),
                                           args.runs, args.replays)
                    record = dict(D=dim, V=vocab, regime=regime, B=batch, form=f"without_replacement k={k} p0.9",
                                  ours_us=without, before_us=before, plain_us=plain, plain_times_k_us=plain * k)
                    records.append(record)
                    print(f"{dim:>5} {vocab:>7} {regime:>6} {batch:>4} {'w/o repl k=4':>14} {without:8.1f} "
                          f"{before:9.1f} {'':>9} {plain:8.1f}   ({without / (plain * k):.2f} of k plain samples)")
    dist.destroy_process_group()
    if args.out:
        path = Path(args.out) / "tp_truncation_cost.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
