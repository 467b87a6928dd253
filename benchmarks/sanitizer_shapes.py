"""A few odd shapes for compute-sanitizer (memcheck, racecheck) on the CUDA sampler:
partial vocabulary tiles, a prime V, B not a multiple of any N tile, B > 256, fp16."""

import torch

import flashsampling_cuda

SHAPES = [  # (B, V, D, dtype)
    (1, 1000, 64, torch.bfloat16),
    (3, 1009, 72, torch.float16),
    (17, 32003, 136, torch.bfloat16),
    (257, 4099, 64, torch.bfloat16),
    (65, 129, 2880, torch.float16),
]

for batch, vocab, dim, dtype in SHAPES:
    hidden = torch.randn(batch, dim, device="cuda", dtype=dtype)
    weight = torch.randn(vocab, dim, device="cuda", dtype=dtype)
    tokens = flashsampling_cuda.sample(hidden, weight, seed=7, num_samples=2)
    torch.cuda.synchronize()
    assert tokens.shape == (batch, 2) and int(tokens.min()) >= 0 and int(tokens.max()) < vocab, (batch, vocab)
    print(f"ok B={batch} V={vocab} D={dim} {dtype}")
