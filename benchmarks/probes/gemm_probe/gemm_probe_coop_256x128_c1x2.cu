#include "gemm_probe.cuh"
GEMM_PROBE_DEFINE(coop_256x128_c1x2, 256, 128, 64, 1, 2, false)
