"""Idle time before cuBLAS's fp32-output matmul in a CUDA graph (the sampled-draft and logits
paths' logits): the matmul alone, after a small kernel, after a memset, bf16 vs fp32 output, and
each graph's replay time (median of 50).

  python3 benchmarks/probes/mm_graph_gap.py --batches 16,64
"""
import argparse

import torch

from stage2_share import captured_graph, graph_timeline  # benchmarks/probes/ (torch alone)


def replay_us(call, reps=50) -> float:
    graph = captured_graph(call)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--shape", default="4096x151936")
    args = parser.parse_args()
    dim, vocab = (int(x) for x in args.shape.split("x"))
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16)
    for batch in (int(b) for b in args.batches.split(",")):
        hidden = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(batch, vocab, device="cuda", dtype=torch.float32)
        small = torch.zeros(batch, device="cuda")
        calls = {
            "mm f32": lambda: torch.mm(hidden, weight.t(), out_dtype=torch.float32),
            "mm bf16": lambda: torch.mm(hidden, weight.t()),
            "add; mm f32": lambda: (small.add_(1), torch.mm(hidden, weight.t(), out_dtype=torch.float32)),
            "zeros; mm f32": lambda: (torch.zeros(batch, device="cuda"),
                                      torch.mm(hidden, weight.t(), out_dtype=torch.float32)),
            "add; mm bf16": lambda: (small.add_(1), torch.mm(hidden, weight.t())),
            "add; mm f32 out=": lambda: (small.add_(1), torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)),
            "add; matmul bf16.float": lambda: (small.add_(1), torch.matmul(hidden, weight.t()).float()),
        }
        for name, call in calls.items():
            try:
                print(f"B={batch} {name}: replay {replay_us(call):.1f} us; {graph_timeline(call)}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"B={batch} {name}: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
