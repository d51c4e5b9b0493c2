// Gemm::linear on small random matrices against a CPU float reference, with and without bias.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "gemm.h"
#include "gpu_test.h"

namespace nanograph {
namespace {

std::vector<bf16> random_bf16(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<bf16> v(n);
  for (bf16& e : v) e = __float2bfloat16(dist(rng));
  return v;
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* dev = nullptr;
  CUDA_CHECK(cudaMalloc(&dev, host.size() * sizeof(T)));
  CUDA_CHECK(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return dev;
}

struct Shape {
  int M, N, K;
};

class GemmTest : public ::testing::TestWithParam<std::tuple<Shape, bool>> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
  }
};

TEST_P(GemmTest, MatchesCpuReference) {
  const auto [shape, with_bias] = GetParam();
  const auto [M, N, K] = shape;
  std::mt19937 rng(M * 131 + N * 7 + K);
  std::vector<bf16> x = random_bf16(size_t(M) * K, 1.0f, rng);
  std::vector<bf16> w = random_bf16(size_t(N) * K, 1.0f / std::sqrt(float(K)), rng);
  std::vector<bf16> b = random_bf16(N, 1.0f, rng);
  std::vector<bf16> poison(size_t(M) * N, __float2bfloat16(NAN));

  bf16* dx = to_device(x);
  bf16* dw = to_device(w);
  bf16* db = to_device(b);
  bf16* dout = to_device(poison);
  Gemm gemm;
  gemm.linear(dx, dw, with_bias ? db : nullptr, dout, M, N, K, /*stream=*/0);
  // Twice through the cached plan, so a stale plan or descriptor would show.
  gemm.linear(dx, dw, with_bias ? db : nullptr, dout, M, N, K, /*stream=*/0);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<bf16> out(size_t(M) * N);
  CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  for (bf16* p : {dx, dw, db, dout}) CUDA_CHECK(cudaFree(p));

  double err2 = 0.0, ref2 = 0.0;
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      float ref = with_bias ? __bfloat162float(b[n]) : 0.0f;
      for (int k = 0; k < K; ++k) {
        ref += __bfloat162float(x[size_t(m) * K + k]) * __bfloat162float(w[size_t(n) * K + k]);
      }
      float got = __bfloat162float(out[size_t(m) * N + n]);
      ASSERT_TRUE(std::isfinite(got)) << "out[" << m << ", " << n << "] was not written";
      err2 += double(got - ref) * (got - ref);
      ref2 += double(ref) * ref;
    }
  }
  EXPECT_LT(std::sqrt(err2 / ref2), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest,
                         ::testing::Combine(::testing::Values(Shape{1, 64, 32}, Shape{7, 96, 64},
                                                              Shape{33, 128, 256},
                                                              Shape{128, 40, 72}, Shape{5, 50, 36}),
                                            ::testing::Bool()));

TEST(GemmErrors, RejectsMisalignedPointer) {
  SKIP_WITHOUT_GPU();
  bf16* buf = nullptr;
  CUDA_CHECK(cudaMalloc(&buf, 4096 * sizeof(bf16)));
  Gemm gemm;
  EXPECT_THROW(gemm.linear(buf + 1, buf, nullptr, buf + 2048, 2, 16, 16, 0),
               std::invalid_argument);
  CUDA_CHECK(cudaFree(buf));
}

}  // namespace
}  // namespace nanograph
