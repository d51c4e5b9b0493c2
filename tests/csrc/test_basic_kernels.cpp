// RMSNorm, add-RMSNorm and SiLU-and-mul through the raw C++ entry points, against a CPU float
// reference on random data (the Python tests cover the same kernels through the bindings).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "activation.h"
#include "norm.h"
#include "gpu_test.h"

namespace nanograph {
namespace {

class BasicKernels : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

std::vector<bf16> random_bf16(size_t n, unsigned seed, float scale = 1.f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<bf16> v(n);
  for (bf16& x : v) x = __float2bfloat16(normal(gen));
  return v;
}

// A device copy of a host vector; `poison` fills it with NaN bytes instead of the host data so
// that any element a kernel fails to write is caught.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<bf16>& host, bool poison = false) : size_(host.size()) {
    CUDA_CHECK(cudaMalloc(&ptr_, size_ * sizeof(bf16)));
    if (poison) {
      CUDA_CHECK(cudaMemset(ptr_, 0xFF, size_ * sizeof(bf16)));
    } else {
      CUDA_CHECK(cudaMemcpy(ptr_, host.data(), size_ * sizeof(bf16), cudaMemcpyHostToDevice));
    }
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  bf16* get() { return ptr_; }
  std::vector<float> to_host() const {
    std::vector<bf16> raw(size_);
    CUDA_CHECK(cudaMemcpy(raw.data(), ptr_, size_ * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<float> out(size_);
    for (size_t i = 0; i < size_; ++i) out[i] = __bfloat162float(raw[i]);
    return out;
  }

 private:
  bf16* ptr_ = nullptr;
  size_t size_;
};

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 2e-2f + 2e-2f * std::fabs(want[i]))) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements differ";
}

// HF LlamaRMSNorm rounding: normalise in fp32, round to bf16, multiply by the bf16 weight.
std::vector<float> rmsnorm_reference(const std::vector<float>& h, const std::vector<bf16>& weight,
                                     int rows, int dim, float eps) {
  std::vector<float> out(h.size());
  for (int r = 0; r < rows; ++r) {
    double sum_sq = 0;
    for (int c = 0; c < dim; ++c) sum_sq += double(h[size_t(r) * dim + c]) * h[size_t(r) * dim + c];
    const float rstd = 1.f / std::sqrt(float(sum_sq / dim) + eps);
    for (int c = 0; c < dim; ++c) {
      const size_t i = size_t(r) * dim + c;
      out[i] = round_bf16(round_bf16(h[i] * rstd) * __bfloat162float(weight[c]));
    }
  }
  return out;
}

std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

TEST_F(BasicKernels, RmsNormMatchesCpuReference) {
  const float eps = 1e-6f;
  for (int dim : {64, 200, 512, 520, 1024, 4096, 5120, 8192}) {
    for (int rows : {1, 5, 33}) {
      SCOPED_TRACE("rows=" + std::to_string(rows) + " dim=" + std::to_string(dim));
      auto x = random_bf16(size_t(rows) * dim, dim + rows, 3.f);
      auto w = random_bf16(dim, dim);
      DeviceBuffer dx(x), dw(w), dout(x, /*poison=*/true);
      rmsnorm(dx.get(), dw.get(), dout.get(), rows, dim, eps, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      expect_close(dout.to_host(), rmsnorm_reference(to_float(x), w, rows, dim, eps), "out");
    }
  }
}

TEST_F(BasicKernels, AddRmsNormUpdatesResidualAndNormalises) {
  const float eps = 1e-5f;
  for (int dim : {64, 520, 4096, 8192}) {
    const int rows = 7;
    SCOPED_TRACE("dim=" + std::to_string(dim));
    auto x = random_bf16(size_t(rows) * dim, dim);
    auto residual = random_bf16(size_t(rows) * dim, dim + 1, 2.f);
    auto w = random_bf16(dim, dim + 2);
    std::vector<float> sum(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      sum[i] = round_bf16(__bfloat162float(x[i]) + __bfloat162float(residual[i]));
    }
    DeviceBuffer dx(x), dr(residual), dw(w);
    add_rmsnorm(dx.get(), dr.get(), dw.get(), rows, dim, eps, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    expect_close(dr.to_host(), sum, "residual");
    expect_close(dx.to_host(), rmsnorm_reference(sum, w, rows, dim, eps), "x");
  }
}

TEST_F(BasicKernels, SiluMulMatchesCpuReference) {
  for (int inter : {8, 1000, 3072, 12288}) {
    for (int rows : {1, 3, 64}) {
      SCOPED_TRACE("rows=" + std::to_string(rows) + " inter=" + std::to_string(inter));
      auto gate_up = random_bf16(size_t(rows) * 2 * inter, inter + rows, 2.f);
      DeviceBuffer dgu(gate_up), dout(std::vector<bf16>(size_t(rows) * inter), /*poison=*/true);
      silu_mul(dgu.get(), dout.get(), rows, inter, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> want(size_t(rows) * inter);
      for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < inter; ++c) {
          const float g = __bfloat162float(gate_up[size_t(r) * 2 * inter + c]);
          const float u = __bfloat162float(gate_up[size_t(r) * 2 * inter + inter + c]);
          want[size_t(r) * inter + c] = g / (1.f + std::exp(-g)) * u;
        }
      }
      expect_close(dout.to_host(), want, "out");
    }
  }
}

TEST(BasicKernelsArguments, RejectUnsupportedSizes) {
  EXPECT_THROW(rmsnorm(nullptr, nullptr, nullptr, 1, 100, 1e-6f, nullptr), std::invalid_argument);
  EXPECT_THROW(rmsnorm(nullptr, nullptr, nullptr, 1, 8200, 1e-6f, nullptr), std::invalid_argument);
  EXPECT_THROW(silu_mul(nullptr, nullptr, 1, 12, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace nanograph
