// What a CUDA-graph IF node costs against the empty launches it would skip (no torch).
//
// A fused truncation call launches, after stage 2, the top_p rounds (five kernels) and the cut
// kernel (one or two), which in most calls of peaked rows find no row: each such launch costs
// about 1-2 us of a graph replay. An IF node whose condition a kernel before it sets (stage 2's
// first thread to list a row) would skip them. This probe replays, R times in one graph each:
//   plain:      setter, then N empty kernels (grid G, every CTA returning at once)
//   if-skipped: setter (condition 0), then an IF node holding the N empty kernels
//   if-taken:   setter (condition 1), then the same IF node (its cost where the rows are there)
//   ifs-each:   setter (conditions 0), then N IF nodes of one empty kernel each
//   setter:     the setter alone (the floor)
// and prints each variant's time per sequence (median of 20 graph launches / R).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/probes/graph_conditionals/probe.cu -o /tmp/graph_conditionals \
//     && /tmp/graph_conditionals [N=7] [G=528] [R=200]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                              \
  do {                                                                                           \
    cudaError_t const err_ = (call);                                                             \
    if (err_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

constexpr int kMostNodes = 16;
struct Handles {
  cudaGraphConditionalHandle at[kMostNodes];
  int count;
};

// Stage 2's stand-in: one block; thread 0 sets each handle it is given (one caller a handle).
__global__ void setter_kernel(Handles const handles, unsigned value) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < handles.count; ++i) cudaGraphSetConditional(handles.at[i], value);
  }
}

// An empty round: every CTA reads the (empty) list and leaves.
__global__ void empty_kernel(int const* list) {
  if (*list > static_cast<int>(blockIdx.x)) asm volatile("trap;");
}

enum class Variant { kPlain, kIfSkipped, kIfTaken, kIfsEach, kSetter };

cudaGraph_t capturing_graph(cudaStream_t stream) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph;
  CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph));
  return graph;
}

// An IF node on `handle` after the stream's captured work; returns its body graph, into which
// `body_stream` then captures.
cudaGraph_t add_if_node(cudaStream_t stream, cudaGraphConditionalHandle handle) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph;
  cudaGraphNode_t const* deps;
  size_t count;
  CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, nullptr, &count));
  cudaGraphNodeParams params = {};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node;
  CHECK(cudaGraphAddNode(&node, graph, deps, nullptr, count, &params));
  CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
  return params.conditional.phGraph_out[0];
}

void launch_empty(cudaStream_t stream, int n, int grid, int const* list) {
  for (int i = 0; i < n; ++i) empty_kernel<<<grid, 256, 0, stream>>>(list);
}

void capture_into(cudaGraph_t body, cudaStream_t body_stream, int n, int grid, int const* list) {
  CHECK(cudaStreamBeginCaptureToGraph(body_stream, body, nullptr, nullptr, 0, cudaStreamCaptureModeRelaxed));
  launch_empty(body_stream, n, grid, list);
  cudaGraph_t captured;
  CHECK(cudaStreamEndCapture(body_stream, &captured));
}

float time_variant(Variant v, int n, int grid, int reps, int const* list) {
  cudaStream_t stream, body_stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&body_stream, cudaStreamNonBlocking));
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  bool const conditional = v == Variant::kIfSkipped || v == Variant::kIfTaken || v == Variant::kIfsEach;
  for (int r = 0; r < reps; ++r) {
    // The handles exist before the setter's launch (created on the graph being captured, reset
    // to 0 at each launch); their IF nodes follow it.
    Handles handles = {};
    handles.count = conditional ? (v == Variant::kIfsEach ? n : 1) : 0;
    for (int i = 0; i < handles.count; ++i) {
      CHECK(cudaGraphConditionalHandleCreate(&handles.at[i], capturing_graph(stream), 0, cudaGraphCondAssignDefault));
    }
    setter_kernel<<<1, 32, 0, stream>>>(handles, v == Variant::kIfTaken ? 1u : 0u);
    if (v == Variant::kPlain) launch_empty(stream, n, grid, list);
    if (v == Variant::kIfSkipped || v == Variant::kIfTaken) {
      capture_into(add_if_node(stream, handles.at[0]), body_stream, n, grid, list);
    }
    if (v == Variant::kIfsEach) {
      for (int i = 0; i < n; ++i) capture_into(add_if_node(stream, handles.at[i]), body_stream, 1, grid, list);
    }
  }
  cudaGraph_t graph;
  CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  std::vector<float> times;
  for (int i = 0; i < 22; ++i) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    if (i >= 2) times.push_back(ms * 1e3f / reps);
  }
  std::sort(times.begin(), times.end());
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  CHECK(cudaStreamDestroy(body_stream));
  return times[times.size() / 2];
}

int main(int argc, char** argv) {
  int const n = argc > 1 ? std::atoi(argv[1]) : 7;
  int const grid = argc > 2 ? std::atoi(argv[2]) : 528;
  int const reps = argc > 3 ? std::atoi(argv[3]) : 200;
  int* list;
  CHECK(cudaMalloc(&list, sizeof(int)));
  CHECK(cudaMemset(list, 0, sizeof(int)));
  if (n < 1 || n > kMostNodes) {
    std::fprintf(stderr, "N must be in [1, %d]\n", kMostNodes);
    return 1;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s: %d empty kernels of %d CTAs a sequence, %d sequences a graph; us a sequence (median of 20)\n",
              prop.name, n, grid, reps);
  char const* names[] = {"plain", "if-skipped", "if-taken", "ifs-each (skipped)", "setter alone"};
  Variant const variants[] = {Variant::kPlain, Variant::kIfSkipped, Variant::kIfTaken, Variant::kIfsEach, Variant::kSetter};
  for (int i = 0; i < 5; ++i) {
    std::printf("  %-20s %7.2f\n", names[i], time_variant(variants[i], n, grid, reps, list));
  }
  return 0;
}
