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
// the rows, as above, also where 9-32 rows run k in chunks so that a bigger tree's verify streams
// the weights while it multiplies (rows_of).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kPanel = 32;  // columns per panel: two 16-float accumulators a row
// On vdpbf16ps with 9-32 rows, k pairs each tile runs before the next tile takes the same 4 KB
// of panel from L1 (chunked_rows).
constexpr int64_t kChunk = 32;
// k pairs ahead (8 KB of panel) that a chunk's first tile asks L2 for, so that the stream from
// memory goes on while the other tiles multiply.
constexpr int64_t kFar = 64;

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

// Ask for the panel ahead of k pair `wp`: kAhead pairs into L1 (128 bytes a pair: two cache lines;
// past the end is harmless, a hint), and for a chunk's leading tile kFar pairs into L2.
template <int ROWS, bool LEAD>
inline void prefetch(const at::BFloat16* wp) {
  _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead<ROWS> * 2 * kPanel), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead<ROWS> * 2 * kPanel + kPanel), _MM_HINT_T0);
  if constexpr (LEAD) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + kFar * 2 * kPanel), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(wp + kFar * 2 * kPanel + kPanel), _MM_HINT_T1);
  }
}

// Where a tile's sums start and end: from zero in registers to the bf16 output rows y [ROWS, N]
// (WHOLE: the tile runs over all of k), or from and to fp32 sums [ROWS, 2] kept between chunks.
struct Out {
  __m512* sums;
  at::BFloat16* y;
  int64_t N, cols;
};

template <int ROWS, bool WHOLE>
inline void begin_sums(__m512 (&acc)[ROWS][2], const Out& out) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; r++) {
    if constexpr (WHOLE) {
      acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    } else {
      acc[r][0] = out.sums[2 * r], acc[r][1] = out.sums[2 * r + 1];
    }
  }
}

template <int ROWS, bool WHOLE>
inline void end_sums(__m512 (&acc)[ROWS][2], const Out& out) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; r++) {
    if constexpr (WHOLE) {
      store_row(out.y + r * out.N, acc[r][0], acc[r][1], out.cols);
    } else {
      out.sums[2 * r] = acc[r][0], out.sums[2 * r + 1] = acc[r][1];
    }
  }
}

// One panel (32 columns) for ROWS rows of x [ROWS, K] (fp32, K even) over k pairs p0..p1, the
// sums from and to `out`: 2 * ROWS accumulators stay in registers meanwhile.
// A 32-bit lane of the packed weight holds w[n, 2p] (low half) and w[n, 2p + 1] (high half); each
// half made an fp32 is a shift or a mask, so the bf16 weights feed fp32 FMAs, twice vdpbf16ps's
// rate on the Xeon (2 vs 0.5 a cycle) for the same multiply-adds at 8 rows and more.
template <int ROWS, bool LEAD, bool WHOLE>
inline void tile(const float* __restrict__ x, int64_t K, const at::BFloat16* __restrict__ w,
                 int64_t p0, int64_t p1, const Out& out, std::false_type /*dot*/) {
  __m512 acc[ROWS][2];
  begin_sums<ROWS, WHOLE>(acc, out);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = p0; p < p1; p++) {
    const at::BFloat16* wp = w + p * 2 * kPanel;
    prefetch<ROWS, LEAD>(wp);
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
  end_sums<ROWS, WHOLE>(acc, out);
}

// The same panel on vdpbf16ps: x [ROWS, K] bf16 (K even), read a k pair (32 bits) at a time and
// broadcast; the packed weight's lanes are already the pairs vdpbf16ps multiplies.
template <int ROWS, bool LEAD, bool WHOLE>
inline void tile(const at::BFloat16* __restrict__ x, int64_t K, const at::BFloat16* __restrict__ w,
                 int64_t p0, int64_t p1, const Out& out, std::true_type /*dot*/) {
  __m512 acc[ROWS][2];
  begin_sums<ROWS, WHOLE>(acc, out);
  for (int64_t p = p0; p < p1; p++) {
    const at::BFloat16* wp = w + p * 2 * kPanel;
    prefetch<ROWS, LEAD>(wp);
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
  end_sums<ROWS, WHOLE>(acc, out);
}

// ROWS = rows (1-8) of tile<ROWS, LEAD, WHOLE>.
template <bool LEAD, bool WHOLE, typename X, typename Dot>
inline void tile_of(int64_t rows, const X* x, int64_t K, const at::BFloat16* w, int64_t p0,
                    int64_t p1, const Out& out, Dot dot) {
  switch (rows) {
    case 8: tile<8, LEAD, WHOLE>(x, K, w, p0, p1, out, dot); break;
    case 7: tile<7, LEAD, WHOLE>(x, K, w, p0, p1, out, dot); break;
    case 6: tile<6, LEAD, WHOLE>(x, K, w, p0, p1, out, dot); break;
    case 5: tile<5, LEAD, WHOLE>(x, K, w, p0, p1, out, dot); break;
    case 4: tile<4, LEAD, WHOLE>(x, K, w, p0, p1, out, dot); break;
    case 3: tile<3, LEAD, WHOLE>(x, K, w, p0, p1, out, dot); break;
    case 2: tile<2, LEAD, WHOLE>(x, K, w, p0, p1, out, dot); break;
    case 1: tile<1, LEAD, WHOLE>(x, K, w, p0, p1, out, dot); break;
    default: break;
  }
}

// All M rows of one panel, in tiles of up to 8 rows (16 accumulators in registers), each tile
// over the whole of k: one row's step and a small tree's verify read the panel once. On vdpbf16ps
// with 9-32 rows (a bigger tree, a batch's trees), tiles after the first would read the panel
// again from cache after the first had streamed it from memory, compute-bound, one time after the
// other; so there k runs in chunks of kChunk pairs that every tile takes in turn while the chunk's
// weights sit in L1, the first tile leading the stream from memory (kFar), and the sums wait in a
// buffer between chunks (exact fp32: each output is still one chain over k from zero whatever M).
// Its tiles are of even size too (17 rows: 6 + 6 + 5, not 8 + 8 + 1): a tile of one or two rows
// has too few chains to hide the instruction's latency. Measured on the Zen 4 EPYC against tile
// after tile (scripts/probe_bf16_linear.py --baseline): a step's Linears 7-10% faster at 9-17
// rows, level at 1-8 and 20-32; from 33 rows (prefill) the sums' trips cost more than the overlap
// gains (64 rows: 5-10%, 512: 15%), so whole k there. The FMA loop, compute-bound from 9 rows on
// the Zen 4, measured 2-6% slower chunked and with even tiles there, and is unmeasured so on the
// Xeon where it is the default: it keeps tiles of 8 and the rest over the whole of k.
constexpr int64_t kChunkedRows = 32;

// Rows of tile t of `tiles` over M rows: even sizes on vdpbf16ps, else 8 and the rest (m: the
// rows of the tiles before).
template <typename Dot>
inline int64_t tile_rows(int64_t t, int64_t tiles, int64_t m, int64_t M) {
  return Dot::value ? M / tiles + (t >= tiles - M % tiles) : std::min<int64_t>(8, M - m);
}

// 9-32 rows on vdpbf16ps: k in chunks, every tile in turn, the sums in a buffer between chunks.
inline void chunked_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w,
                         at::BFloat16* y, int64_t N, int64_t cols) {
  const int64_t pairs = K / 2, tiles = (M + 7) / 8;
  alignas(64) __m512 sums[2 * kChunkedRows];
  for (int64_t i = 0; i < 2 * M; i++) sums[i] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += kChunk) {
    const int64_t p1 = std::min(pairs, p0 + kChunk);
    for (int64_t t = 0, m = 0; t < tiles; t++) {
      const int64_t rows = tile_rows<std::true_type>(t, tiles, m, M);
      const Out out{sums + 2 * m, nullptr, N, cols};
      if (t == 0)
        tile_of<true, false>(rows, x + m * K, K, w, p0, p1, out, std::true_type{});
      else
        tile_of<false, false>(rows, x + m * K, K, w, p0, p1, out, std::true_type{});
      m += rows;
    }
  }
  for (int64_t r = 0; r < M; r++) store_row(y + r * N, sums[2 * r], sums[2 * r + 1], cols);
}

template <typename X, typename Dot>
void rows_of(const X* x, int64_t M, int64_t K, const at::BFloat16* w, at::BFloat16* y, int64_t N,
             int64_t cols, Dot dot) {
  if constexpr (Dot::value) {
    if (M > 8 && M <= kChunkedRows) return chunked_rows(x, M, K, w, y, N, cols);
  }
  const int64_t tiles = (M + 7) / 8;
  for (int64_t t = 0, m = 0; t < tiles; t++) {
    const int64_t rows = tile_rows<Dot>(t, tiles, m, M);
    tile_of<false, true>(rows, x + m * K, K, w, 0, K / 2, Out{nullptr, y + m * N, N, cols}, dot);
    m += rows;
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
        rows_of(xh, M, Kp, wpp + p * panel_size, yp + p * kPanel, N, cols, std::true_type{});
      else
        rows_of(xf, M, Kp, wpp + p * panel_size, yp + p * kPanel, N, cols, std::false_type{});
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
