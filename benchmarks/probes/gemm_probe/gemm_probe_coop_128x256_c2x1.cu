#include "gemm_probe.cuh"
GEMM_PROBE_DEFINE(coop_128x256_c2x1, 128, 256, 64, 2, 1, false)
