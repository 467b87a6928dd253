#include "gemm_probe.cuh"
GEMM_PROBE_DEFINE(coop_256x128_c2x1, 256, 128, 64, 2, 1, false)
