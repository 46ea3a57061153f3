// y[M, N] = x[M, K] @ W.T for the few rows of a decode step (1) or a verify (a tree's nodes), bf16
// in and out on AVX-512, fp32 products and sums. W is packed in 32-column panels of k pairs:
// wp [ceil(N / 32), ceil(K / 2), 32, 2], zero-padded: a 64-byte load holds 16 columns' k pair.
//
// Why not oneDNN's prepacked bf16 Linear (cpu_linears="onednn"): at one row it reads the weights
// at ~16 GB/s on a 2-core Xeon with AVX512-BF16, 60% of the read bandwidth there (profile of the
// compiled plain step: 16.9 ms of a 21 ms step in its calls); from 16 rows it is bound by
// vdpbf16ps, which runs at a quarter of the FMAs' rate there (0.5 against 2 a cycle: half the
// multiply-adds a cycle); and every call goes through a Python op (the packed weight is an opaque
// tensor). Here the weight is an ordinary tensor, the op is C++, the stream is prefetched, and
// the bf16 weights feed fp32 FMAs (scripts/probe_bf16_linear.py). Each output is one fp32
// FMA chain over k = 0..K-1 from zero, whatever the number of rows: a verify's rows equal
// one-row steps' bit for bit.
//
// With `dot`, vdpbf16ps multiplies instead (the bf16 inputs as they are, a k pair an instruction;
// denormals flushed): on a 2-core AMD EPYC (Zen 4) it runs at the FMAs' rate with twice the
// multiply-adds, so level with them at 1-4 rows, 1.3-1.7x at 8-16 and 2x at 64-512 (the Xeon
// above: the other way round). Each output is then one vdpbf16ps chain over the k pairs, whatever
// the rows, as above.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kPanel = 32;  // columns per panel: two 16-float accumulators a row

// k pairs prefetched ahead (128 bytes of panel a pair).
template <int ROWS>
constexpr int64_t kAhead = ROWS == 1 ? 8 : 16;

inline void store_row(at::BFloat16* y, __m512 a0, __m512 a1, int64_t cols) {
  const __m256i lo = (__m256i)_mm512_cvtneps_pbh(a0), hi = (__m256i)_mm512_cvtneps_pbh(a1);
  if (cols == kPanel) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16), hi);
  } else {  // the last panel of an N that is not a multiple of 32
    alignas(64) at::BFloat16 tail[kPanel];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tail), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(tail + 16), hi);
    std::memcpy(y, tail, cols * sizeof(at::BFloat16));
  }
}

// One panel (32 columns) for ROWS rows of x [ROWS, K] (fp32, K even): 2 * ROWS accumulators stay
// in registers. A 32-bit lane of the packed weight holds w[n, 2p] (low half) and w[n, 2p + 1]
// (high half); each half made an fp32 is a shift or a mask, so the bf16 weights feed fp32 FMAs,
// twice vdpbf16ps's rate here (2 vs 0.5 a cycle) for the same multiply-adds at 8 rows and more.
template <int ROWS>
inline void panel(const float* __restrict__ x, int64_t K, const at::BFloat16* __restrict__ w,
                  at::BFloat16* __restrict__ y, int64_t N, int64_t cols, std::false_type /*dot*/) {
  __m512 acc[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < K / 2; p++) {
    const at::BFloat16* wp = w + p * 2 * kPanel;
    // 128 bytes a pair: two cache lines to ask for (past the end is harmless: a hint)
    _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead<ROWS> * 2 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead<ROWS> * 2 * kPanel + kPanel), _MM_HINT_T0);
    const __m512i v0 = _mm512_loadu_si512(wp), v1 = _mm512_loadu_si512(wp + kPanel);
    const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
    const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
    const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));
    const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {  // k = 2p, then 2p + 1: one FMA chain over k per output
      const __m512 a = _mm512_set1_ps(x[r * K + 2 * p]), b = _mm512_set1_ps(x[r * K + 2 * p + 1]);
      acc[r][0] = _mm512_fmadd_ps(b, odd0, _mm512_fmadd_ps(a, even0, acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(b, odd1, _mm512_fmadd_ps(a, even1, acc[r][1]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; r++) store_row(y + r * N, acc[r][0], acc[r][1], cols);
}

// The same panel on vdpbf16ps: x [ROWS, K] bf16 (K even), read a k pair (32 bits) at a time and
// broadcast; the packed weight's lanes are already the pairs vdpbf16ps multiplies.
template <int ROWS>
inline void panel(const at::BFloat16* __restrict__ x, int64_t K, const at::BFloat16* __restrict__ w,
                  at::BFloat16* __restrict__ y, int64_t N, int64_t cols, std::true_type /*dot*/) {
  __m512 acc[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; p++) {
    const at::BFloat16* wp = w + p * 2 * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead<ROWS> * 2 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead<ROWS> * 2 * kPanel + kPanel), _MM_HINT_T0);
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(wp), v1 = (__m512bh)_mm512_loadu_si512(wp + kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v0, a);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v1, a);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; r++) store_row(y + r * N, acc[r][0], acc[r][1], cols);
}

template <int ROWS, typename X, typename Dot>
void rows_of(const X* x, int64_t M, int64_t K, const at::BFloat16* w, at::BFloat16* y, int64_t N,
             int64_t cols, Dot dot) {
  int64_t m = 0;
  for (; m + ROWS <= M; m += ROWS) panel<ROWS>(x + m * K, K, w, y + m * N, N, cols, dot);
  switch (M - m) {  // the rest, fewer than ROWS
    case 7: panel<7>(x + m * K, K, w, y + m * N, N, cols, dot); break;
    case 6: panel<6>(x + m * K, K, w, y + m * N, N, cols, dot); break;
    case 5: panel<5>(x + m * K, K, w, y + m * N, N, cols, dot); break;
    case 4: panel<4>(x + m * K, K, w, y + m * N, N, cols, dot); break;
    case 3: panel<3>(x + m * K, K, w, y + m * N, N, cols, dot); break;
    case 2: panel<2>(x + m * K, K, w, y + m * N, N, cols, dot); break;
    case 1: panel<1>(x + m * K, K, w, y + m * N, N, cols, dot); break;
    default: break;
  }
}

at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& wp, int64_t N, bool dot) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16,
              "bf16_linear: bf16 only, got ", x_in.scalar_type(), " and ", wp.scalar_type());
  TORCH_CHECK(x_in.device().is_cpu() && wp.device().is_cpu(), "bf16_linear: CPU tensors only");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(wp.dim() == 4 && wp.size(1) == (K + 1) / 2 && wp.size(2) == kPanel && wp.size(3) == 2 &&
                  wp.size(0) * kPanel >= N && wp.is_contiguous(),
              "bf16_linear: packed weight ", wp.sizes(), " does not hold ", N, " outputs of ", K,
              " inputs in 32-column panels of k pairs");
  // inputs read by every panel: fp32 for the FMAs, bf16 for vdpbf16ps; an odd K gets a zero
  // column to meet the weight's zero row
  const at::Tensor padded = K % 2 ? at::constant_pad_nd(x_in, {0, 1}) : x_in;
  const at::Tensor x = (dot ? padded : padded.to(at::kFloat)).contiguous();
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x_in.options());
  const int64_t M = K == 0 ? 0 : x_in.numel() / K, Kp = K + K % 2;
  if (M == 0 || N == 0) return y;
  const float* xf = dot ? nullptr : x.data_ptr<float>();
  const at::BFloat16* xh = dot ? x.data_ptr<at::BFloat16>() : nullptr;
  const auto* wpp = wp.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t panels = (N + kPanel - 1) / kPanel, panel_size = Kp * kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      if (dot)
        rows_of<8>(xh, M, Kp, wpp + p * panel_size, yp + p * kPanel, N, cols, std::true_type{});
      else
        rows_of<8>(xf, M, Kp, wpp + p * panel_size, yp + p * kPanel, N, cols, std::false_type{});
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("bf16_linear(Tensor x, Tensor packed_weight, int out_features, bool dot=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
}
