// y[M, N] = x[M, K] @ W.T for the few rows of a decode step (1) or a verify (a tree's nodes),
// fp32 on AVX2 + FMA, W packed in 24-column panels: wp [ceil(N / 24), K, 24], zero-padded.
//
// Why not Inductor's C++ GEMM template, which runs the same 4 x 24 register block: its loop
// leaves the weight stream to the hardware prefetcher, and at 4 rows the FMAs and the loads
// then add up instead of overlapping (AMD EPYC, AVX2, 2 threads, the default target's lm_head:
// 1 row 6.3 ms, 4 rows 8.9 ms). A software prefetch a few panel rows ahead hides the loads
// (scripts/probe_avx2_linear.py, docs/measurements.md: every shape faster at 1 and at 4 rows, 4 rows 1.1-1.5x
// one row). Each output is one fused multiply-add chain over k = 0..K-1 from zero, the
// template's order: results are bitwise the template's, and a row's values never depend on how
// many rows came with it (a verify's rows equal one-row steps').
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernel_calls.h"

namespace {

constexpr int64_t kPanel = 24;  // columns per panel: three 8-float AVX registers

// Panel rows prefetched ahead. Measured (AMD EPYC AVX2, 2 threads, the target's shapes):
// one row is fastest 8 ahead, four rows 32 ahead (more FMAs a panel row, so more time).
template <int ROWS>
constexpr int64_t kAhead = ROWS == 1 ? 8 : 32;

// One panel (24 columns) for ROWS rows: 3 * ROWS accumulators stay in registers.
template <int ROWS>
inline void panel(const float* __restrict__ x, int64_t K, const float* __restrict__ w,
                  float* __restrict__ y, int64_t N, int64_t cols) {
  // Accumulators as named registers, not an array: GCC kept an array's copy on the stack up to
  // date, 12 stores a k at 4 rows (half the kernel's speed).
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
  __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
  for (int64_t k = 0; k < K; k++) {
    const float* wk = w + k * kPanel;
    // 96 bytes a panel row: two cache lines to ask for (past the end is harmless: a hint)
    _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead<ROWS> * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead<ROWS> * kPanel + 16), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16);
    __m256 a = _mm256_broadcast_ss(x + k);
    a00 = _mm256_fmadd_ps(a, w0, a00), a01 = _mm256_fmadd_ps(a, w1, a01), a02 = _mm256_fmadd_ps(a, w2, a02);
    if constexpr (ROWS > 1) {
      a = _mm256_broadcast_ss(x + K + k);
      a10 = _mm256_fmadd_ps(a, w0, a10), a11 = _mm256_fmadd_ps(a, w1, a11), a12 = _mm256_fmadd_ps(a, w2, a12);
    }
    if constexpr (ROWS > 2) {
      a = _mm256_broadcast_ss(x + 2 * K + k);
      a20 = _mm256_fmadd_ps(a, w0, a20), a21 = _mm256_fmadd_ps(a, w1, a21), a22 = _mm256_fmadd_ps(a, w2, a22);
    }
    if constexpr (ROWS > 3) {
      a = _mm256_broadcast_ss(x + 3 * K + k);
      a30 = _mm256_fmadd_ps(a, w0, a30), a31 = _mm256_fmadd_ps(a, w1, a31), a32 = _mm256_fmadd_ps(a, w2, a32);
    }
  }
  const __m256 acc[4][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
  for (int r = 0; r < ROWS; r++) {
    if (cols == kPanel) {
      for (int j = 0; j < 3; j++) _mm256_storeu_ps(y + r * N + 8 * j, acc[r][j]);
    } else {  // the last panel of an N that is not a multiple of 24
      alignas(32) float tail[kPanel];
      for (int j = 0; j < 3; j++) _mm256_store_ps(tail + 8 * j, acc[r][j]);
      for (int64_t c = 0; c < cols; c++) y[r * N + c] = tail[c];
    }
  }
}

// Panels p0..p1 of a LinearCall (fp32 x, weight and y): what each thread of a parallel region
// computes (eagle::LinearPanels).
void panels(const eagle::LinearCall& c, int64_t p0, int64_t p1) {
  const float* xp = static_cast<const float*>(c.x);
  const float* wpp = static_cast<const float*>(c.w);
  float* yp = static_cast<float*>(c.y);
  const int64_t M = c.M, K = c.K, N = c.N;
  for (int64_t p = p0; p < p1; p++) {
    const float* w = wpp + p * K * kPanel;
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    float* yc = yp + p * kPanel;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) panel<4>(xp + m * K, K, w, yc + m * N, N, cols);
    switch (M - m) {
      case 3: panel<3>(xp + m * K, K, w, yc + m * N, N, cols); break;
      case 2: panel<2>(xp + m * K, K, w, yc + m * N, N, cols); break;
      case 1: panel<1>(xp + m * K, K, w, yc + m * N, N, cols); break;
      default: break;
    }
  }
}

at::Tensor avx2_linear(const at::Tensor& x_in, const at::Tensor& wp, int64_t N) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat,
              "avx2_linear: fp32 only, got ", x_in.scalar_type(), " and ", wp.scalar_type());
  TORCH_CHECK(x_in.device().is_cpu() && wp.device().is_cpu(), "avx2_linear: CPU tensors only");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(wp.dim() == 3 && wp.size(1) == K && wp.size(2) == kPanel && wp.size(0) * kPanel >= N &&
                  wp.is_contiguous(),
              "avx2_linear: packed weight ", wp.sizes(), " does not hold ", N, " outputs of ", K,
              " inputs in 24-column panels");
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  if (M == 0 || N == 0) return y;
  const eagle::LinearCall call{x.data_ptr<float>(), M, K, wp.data_ptr<float>(), nullptr, y.data_ptr<float>(), N, false};
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) { panels(call, begin, end); });
  return y;
}

// The address of panels (eagle::LinearPanels), for decoder_layers.cpp.
int64_t avx2_linear_panels() { return reinterpret_cast<int64_t>(static_cast<eagle::LinearPanels>(&panels)); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("avx2_linear(Tensor x, Tensor packed_weight, int out_features) -> Tensor");
  m.def("avx2_linear_panels() -> int", &avx2_linear_panels);
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("avx2_linear", &avx2_linear);
}
