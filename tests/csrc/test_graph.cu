// GraphManager: bucket choice (host only), and capture + replay of a small kernel sequence checked
// against the same sequence run eagerly.
#include <gtest/gtest.h>

#include <vector>

#include "graph.h"
#include "gpu_test.h"

namespace nanograph {
namespace {

__global__ void affine_kernel(float* x, const int* n, float a, float b) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < *n) x[i] = a * x[i] + b;
}

TEST(GraphBuckets, DefaultBucketsFollowThePowersThenMultiplesOfEight) {
  EXPECT_EQ(default_decode_buckets(1), (std::vector<int>{1}));
  EXPECT_EQ(default_decode_buckets(3), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(default_decode_buckets(20), (std::vector<int>{1, 2, 4, 8, 16, 20}));
  EXPECT_EQ(default_decode_buckets(32), (std::vector<int>{1, 2, 4, 8, 16, 24, 32}));
  std::vector<int> b256 = default_decode_buckets(256);
  EXPECT_EQ(b256.size(), 35u);
  EXPECT_EQ(b256.back(), 256);
  EXPECT_THROW(default_decode_buckets(0), std::invalid_argument);
}

TEST(GraphBuckets, SmallestBucketAtLeastTheBatch) {
  GraphManager graphs({16, 1, 8, 2, 4, 8});
  EXPECT_EQ(graphs.buckets(), (std::vector<int>{1, 2, 4, 8, 16}));
  EXPECT_EQ(graphs.bucket_for(1), 1);
  EXPECT_EQ(graphs.bucket_for(3), 4);
  EXPECT_EQ(graphs.bucket_for(8), 8);
  EXPECT_EQ(graphs.bucket_for(9), 16);
  EXPECT_EQ(graphs.bucket_for(16), 16);
  EXPECT_EQ(graphs.bucket_for(17), -1);  // beyond the largest bucket: run eagerly
}

TEST(GraphManager, ReplayMatchesEagerAndReadsDeviceInputs) {
  SKIP_WITHOUT_GPU();
  const int capacity = 4096;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  float *x_graph, *x_eager;
  int* n_dev;
  ASSERT_EQ(cudaMalloc(&x_graph, capacity * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&x_eager, capacity * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&n_dev, sizeof(int)), cudaSuccess);

  auto sequence = [&](float* x) {
    affine_kernel<<<capacity / 256, 256, 0, stream>>>(x, n_dev, 2.0f, 1.0f);
    affine_kernel<<<capacity / 256, 256, 0, stream>>>(x, n_dev, -0.5f, 3.0f);
    affine_kernel<<<capacity / 256, 256, 0, stream>>>(x, n_dev, 1.5f, -2.0f);
  };
  GraphManager graphs({capacity});
  graphs.capture(capacity, stream, [&] { sequence(x_graph); });
  ASSERT_TRUE(graphs.captured(capacity));

  std::vector<float> init(capacity);
  for (int step = 0; step < 3; ++step) {
    // Each replay sees new data and a new active length through device memory.
    int n = 1000 + 1000 * step;
    for (int i = 0; i < capacity; ++i) init[i] = static_cast<float>((i * 37 + step * 11) % 101) - 50.0f;
    ASSERT_EQ(cudaMemcpy(x_graph, init.data(), capacity * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(x_eager, init.data(), capacity * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(n_dev, &n, sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
    graphs.replay(capacity, stream);
    sequence(x_eager);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> g(capacity), e(capacity);
    cudaMemcpy(g.data(), x_graph, capacity * sizeof(float), cudaMemcpyDeviceToHost);
    cudaMemcpy(e.data(), x_eager, capacity * sizeof(float), cudaMemcpyDeviceToHost);
    for (int i = 0; i < capacity; ++i) {
      float expected = i < n ? 1.5f * (-0.5f * (2.0f * init[i] + 1.0f) + 3.0f) - 2.0f : init[i];
      ASSERT_EQ(g[i], e[i]) << "element " << i << " at step " << step;
      ASSERT_FLOAT_EQ(g[i], expected) << "element " << i << " at step " << step;
    }
  }
  EXPECT_THROW(graphs.replay(8, stream), std::invalid_argument);
  cudaFree(x_graph);
  cudaFree(x_eager);
  cudaFree(n_dev);
  cudaStreamDestroy(stream);
}

TEST(GraphManager, VariantsOfABucketAreSeparateGraphs) {
  SKIP_WITHOUT_GPU();
  const int n = 1024;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  float* x;
  int* n_dev;
  ASSERT_EQ(cudaMalloc(&x, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&n_dev, sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(n_dev, &n, sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);

  GraphManager graphs({n});
  graphs.capture(n, stream, [&] { affine_kernel<<<n / 256, 256, 0, stream>>>(x, n_dev, 2.0f, 1.0f); }, 0);
  graphs.capture(n, stream, [&] { affine_kernel<<<n / 256, 256, 0, stream>>>(x, n_dev, 0.0f, 5.0f); }, 2);
  EXPECT_TRUE(graphs.captured(n, 0));
  EXPECT_FALSE(graphs.captured(n, 1));
  EXPECT_TRUE(graphs.captured(n, 2));

  std::vector<float> init(n), got(n);
  for (int i = 0; i < n; ++i) init[i] = static_cast<float>(i % 17) - 8.0f;
  ASSERT_EQ(cudaMemcpy(x, init.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  graphs.replay(n, stream, 0);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < n; ++i) ASSERT_FLOAT_EQ(got[i], 2.0f * init[i] + 1.0f) << "variant 0, element " << i;
  graphs.replay(n, stream, 2);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < n; ++i) ASSERT_FLOAT_EQ(got[i], 5.0f) << "variant 2, element " << i;
  EXPECT_THROW(graphs.replay(n, stream, 1), std::invalid_argument);
  cudaFree(x);
  cudaFree(n_dev);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace nanograph
