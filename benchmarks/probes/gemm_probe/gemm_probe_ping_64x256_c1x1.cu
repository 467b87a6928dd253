#include "gemm_probe.cuh"
GEMM_PROBE_DEFINE(ping_64x256_c1x1, 64, 256, 64, 1, 1, true)
