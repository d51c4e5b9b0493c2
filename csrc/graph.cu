// Decode graph manager: bucket choice, capture and replay. The graphs read every per-step value
// (token ids, positions, slots, context lengths, block tables) from fixed device buffers, so one
// capture per bucket serves every later step without re-instantiation.
#include "graph.h"

#include <algorithm>

namespace nanograph {

std::vector<int> default_decode_buckets(int max_num_seqs) {
  require(max_num_seqs >= 1, "max_num_seqs must be at least 1, got " + std::to_string(max_num_seqs));
  std::vector<int> buckets;
  for (int b : {1, 2, 4}) {
    if (b < max_num_seqs) buckets.push_back(b);
  }
  for (int b = 8; b < max_num_seqs; b += 8) buckets.push_back(b);
  buckets.push_back(max_num_seqs);
  return buckets;
}

GraphManager::GraphManager(std::vector<int> buckets) : buckets_(std::move(buckets)) {
  std::sort(buckets_.begin(), buckets_.end());
  buckets_.erase(std::unique(buckets_.begin(), buckets_.end()), buckets_.end());
  require(!buckets_.empty() && buckets_.front() >= 1, "graph buckets must be positive batch sizes");
}

GraphManager::~GraphManager() {
  for (auto& [bucket, exec] : graphs_) cudaGraphExecDestroy(exec);
}

int GraphManager::bucket_for(int batch) const {
  auto it = std::lower_bound(buckets_.begin(), buckets_.end(), batch);
  return it == buckets_.end() ? -1 : *it;
}

void GraphManager::capture(int bucket, cudaStream_t stream, const std::function<void()>& body,
                           int variant) {
  require(std::binary_search(buckets_.begin(), buckets_.end(), bucket),
          "batch " + std::to_string(bucket) + " is not a graph bucket");
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    body();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  CUDA_CHECK(err);
  auto old = graphs_.find({bucket, variant});
  if (old != graphs_.end()) cudaGraphExecDestroy(old->second);
  graphs_[{bucket, variant}] = exec;
}

void GraphManager::replay(int bucket, cudaStream_t stream, int variant) const {
  auto it = graphs_.find({bucket, variant});
  require(it != graphs_.end(), "no graph captured for bucket " + std::to_string(bucket) +
                                   (variant != 0 ? " (variant " + std::to_string(variant) + ")" : ""));
  CUDA_CHECK(cudaGraphLaunch(it->second, stream));
}

}  // namespace nanograph
