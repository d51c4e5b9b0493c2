// Decode graph manager: CUDA graphs per batch bucket, captured once over static buffers with
// cudaStreamBeginCapture/EndCapture and replayed with cudaGraphLaunch every step. A bucket may
// hold several variants of its graph (the model's: without and with the greedy argmax).
#pragma once
#include "common.h"

#include <functional>
#include <map>
#include <vector>

namespace nanograph {

// [1, 2, 4, 8, 16, 24, 32, ...] (multiples of 8 from 8) up to max_num_seqs, which is always the
// last bucket.
std::vector<int> default_decode_buckets(int max_num_seqs);

class GraphManager {
 public:
  explicit GraphManager(std::vector<int> buckets);
  ~GraphManager();
  GraphManager(const GraphManager&) = delete;
  GraphManager& operator=(const GraphManager&) = delete;

  const std::vector<int>& buckets() const { return buckets_; }
  // Smallest bucket >= batch, or -1 when the batch exceeds the largest bucket (run eagerly).
  int bucket_for(int batch) const;

  // Records body() on `stream` into the graph of (bucket, variant) and instantiates it. `body`
  // must enqueue its work on `stream` (or on streams it forks from and joins back to `stream`)
  // and must not allocate or synchronise.
  void capture(int bucket, cudaStream_t stream, const std::function<void()>& body, int variant = 0);
  bool captured(int bucket, int variant = 0) const { return graphs_.count({bucket, variant}) > 0; }
  void replay(int bucket, cudaStream_t stream, int variant = 0) const;

 private:
  std::vector<int> buckets_;
  std::map<std::pair<int, int>, cudaGraphExec_t> graphs_;  // (bucket, variant)
};

}  // namespace nanograph
