#include "gemm_probe.cuh"
GEMM_PROBE_DEFINE(coop_128x128_c1x1, 128, 128, 64, 1, 1, false)
