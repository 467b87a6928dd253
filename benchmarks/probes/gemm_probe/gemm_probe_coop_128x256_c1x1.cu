#include "gemm_probe.cuh"
GEMM_PROBE_DEFINE(coop_128x256_c1x1, 128, 256, 64, 1, 1, false)
