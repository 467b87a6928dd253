#!/usr/bin/env bash
# Sets up (scripts/setup_env.sh) and samples tokens for an LM-head-shaped problem on the
# GPU if there is one, else on the CPU; prints the tokens, the time per call next to torch's
# matmul -> softmax -> multinomial on the same device, and a chi-square check of exactness.
# Arguments go to the demo: --batch, --dim, --vocab, --dtype, --device, --steps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m flashsampling_cuda.demo "$@"
