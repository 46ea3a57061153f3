// y[M, N] = x[M, K] @ W.T for the few rows of a decode step (1) or a verify (a tree's nodes), bf16
// in and out on AVX-512 (or AMX tiles; on CPUs without AVX512-BF16 an AVX2 build, below), fp32
// products and sums. W is packed in 32-column panels of k pairs: wp [ceil(N / 32), ceil(K / 2),
// 32, 2], zero-padded: a 64-byte load holds 16 columns' k pair.
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
// the rows, as above, also where 2-32 rows run k in chunks so that a bigger tree's verify streams
// the weights while it multiplies (rows_of).
//
// On a CPU with AMX (set_amx, the default there: bf16_linear.multiply_default) the `dot` calls
// multiply on the tiles instead (amx_panels below): the same panels are B tiles as they lie. On a
// 2-core Xeon with AMX, 2 threads, weights streamed from memory (scripts/probe_bf16_linear.py,
// results/probe_bf16_linear_amx_xeon.json): the 49152 x 576 lm_head at 1 / 7 / 16 / 64 rows in
// 2.48 / 2.60 / 3.01 / 5.40 ms against 2.92 / 3.44 / 6.53 / 23.5 on vdpbf16ps and oneDNN's (AMX
// too, through a Python op) 4.25 / 4.30 / 4.55 / 5.03; a step's Linears at 16 rows cost 1.26 a
// one-row step's (vdpbf16ps: 2.3). int8 weights 1.50 / 1.65 / 2.01 ms against 1.99 / 3.83 / 7.11.
//
// int8 weights (int8_linear: weight-only int8, one fp32 scale a column): the same panels with a
// byte a weight, half the bytes a step streams. Each k pair of 32 columns (64 bytes, one cache
// line) is made fp32 in registers (exact: |q| <= 127) and then, for vdpbf16ps, bf16 (exact too),
// and multiplied as the bf16 weights are; an output is its chain over k times its scale, rounded
// to bf16 once, whatever the rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "avx2_math.h"
#include "kernel_calls.h"

namespace {

constexpr int64_t kPanel = 32;  // columns per panel: two 16-float accumulators a row (AVX2: four 8-float)

#if defined(__AVX512BF16__)
// Rows of tile t of `tiles` over M rows, sizes as even as can be (17 rows in 3 tiles: 5, 6, 6).
inline int64_t even_rows(int64_t t, int64_t tiles, int64_t M) { return M / tiles + (t >= tiles - M % tiles); }

// On vdpbf16ps with 2-32 rows (int8 weights: 9-32), the bytes of bf16 panel (32 k pairs) each
// tile runs before the next tile takes them from L1 (chunked_rows; int8 weights: a chunk made bf16
// into that much).
constexpr int64_t kChunkBytes = 4096;
// bf16 k pairs ahead (8 KB of panel, whatever the weights' type) that a chunk's first tile (int8:
// the chunk's conversion) asks L2 for, so that the stream from memory goes on while the other
// tiles multiply.
constexpr int64_t kFar = 64;

// k pairs prefetched ahead (128 bytes of bf16 panel a pair: the same bytes ahead for int8).
template <int ROWS>
constexpr int64_t kAhead = ROWS == 1 ? 8 : 16;

// Bytes of panel a k pair: 128 for bf16 weights, 64 for int8.
template <typename W>
constexpr int64_t kPairBytes = 2 * kPanel * sizeof(W);

// scale: the columns' int8 scales (nullptr for bf16 weights).
inline void store_row(at::BFloat16* y, __m512 a0, __m512 a1, int64_t cols, const float* scale) {
  if (scale) a0 = _mm512_mul_ps(a0, _mm512_loadu_ps(scale)), a1 = _mm512_mul_ps(a1, _mm512_loadu_ps(scale + 16));
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

// Ask for the panel ahead of k pair `wp`: kAhead bf16 pairs' bytes into L1 (a pair's cache lines;
// past the end is harmless, a hint), and for a chunk's leading tile kFar bf16 pairs' bytes into L2.
template <int ROWS, bool LEAD, typename W>
inline void prefetch(const W* wp) {
  const char* b = reinterpret_cast<const char*>(wp);
#pragma GCC unroll 2
  for (int64_t line = 0; line < kPairBytes<W>; line += 64)
    _mm_prefetch(b + kAhead<ROWS> * kPairBytes<at::BFloat16> + line, _MM_HINT_T0);
  if constexpr (LEAD) {
#pragma GCC unroll 2
    for (int64_t line = 0; line < kPairBytes<W>; line += 64)
      _mm_prefetch(b + kFar * kPairBytes<at::BFloat16> + line, _MM_HINT_T1);
  }
}

// A k pair of a panel's 32 columns as the FMA loop takes it: w[n, 2p] (even) and w[n, 2p + 1]
// (odd) in fp32, columns 0-15 in [0], 16-31 in [1]. A 32-bit lane of bf16 weights holds the pair,
// the even one in its low half: each made an fp32 is a shift or a mask.
inline void load_pair(const at::BFloat16* wp, __m512 (&even)[2], __m512 (&odd)[2]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512i v0 = _mm512_loadu_si512(wp), v1 = _mm512_loadu_si512(wp + kPanel);
  even[0] = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
  even[1] = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
  odd[0] = _mm512_castsi512_ps(_mm512_and_si512(v0, high));
  odd[1] = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
}

// int8 weights: 32 bytes (16 columns' pairs) widened to 16-bit lanes, each half sign-extended.
inline void load_pair(const int8_t* wp, __m512 (&even)[2], __m512 (&odd)[2]) {
  for (int h = 0; h < 2; h++) {
    const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + h * kPanel)));
    even[h] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16));
    odd[h] = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16));
  }
}

// A k pair of 32 columns as vdpbf16ps takes it: bf16 weights' lanes already are the pairs; int8
// ones go through fp32 (16 weights at a time) to bf16, exactly.
inline void load_pair(const at::BFloat16* wp, __m512bh (&v)[2]) {
  v[0] = (__m512bh)_mm512_loadu_si512(wp), v[1] = (__m512bh)_mm512_loadu_si512(wp + kPanel);
}

inline void load_pair(const int8_t* wp, __m512bh (&v)[2]) {
  for (int h = 0; h < 2; h++) {
    const auto* q = reinterpret_cast<const __m128i*>(wp + h * kPanel);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    v[h] = _mm512_cvtne2ps_pbh(hi, lo);
  }
}

// Where a tile's sums start and end: from zero in registers to the bf16 output rows y [ROWS, N]
// (WHOLE: the tile runs over all of k), or from and to fp32 sums [ROWS, 2] kept between chunks.
struct Out {
  __m512* sums;
  at::BFloat16* y;
  int64_t N, cols;
  const float* scale;  // int8 weights' column scales, else nullptr
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
      store_row(out.y + r * out.N, acc[r][0], acc[r][1], out.cols, out.scale);
    } else {
      out.sums[2 * r] = acc[r][0], out.sums[2 * r + 1] = acc[r][1];
    }
  }
}

// One panel (32 columns) for ROWS rows of x [ROWS, K] (fp32, K even) over k pairs p0..p1, the
// sums from and to `out`: 2 * ROWS accumulators stay in registers meanwhile. The weights made
// fp32 (load_pair) feed fp32 FMAs, twice vdpbf16ps's rate on the Xeon (2 vs 0.5 a cycle) for the
// same multiply-adds at 8 rows and more.
template <int ROWS, bool LEAD, bool WHOLE, typename W>
inline void tile(const float* __restrict__ x, int64_t K, const W* __restrict__ w, int64_t p0,
                 int64_t p1, const Out& out, std::false_type /*dot*/) {
  __m512 acc[ROWS][2];
  begin_sums<ROWS, WHOLE>(acc, out);
  for (int64_t p = p0; p < p1; p++) {
    const W* wp = w + p * 2 * kPanel;
    prefetch<ROWS, LEAD>(wp);
    __m512 even[2], odd[2];
    load_pair(wp, even, odd);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {  // k = 2p, then 2p + 1: one FMA chain over k per output
      const __m512 a = _mm512_set1_ps(x[r * K + 2 * p]), b = _mm512_set1_ps(x[r * K + 2 * p + 1]);
      acc[r][0] = _mm512_fmadd_ps(b, odd[0], _mm512_fmadd_ps(a, even[0], acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(b, odd[1], _mm512_fmadd_ps(a, even[1], acc[r][1]));
    }
  }
  end_sums<ROWS, WHOLE>(acc, out);
}

// The same panel on vdpbf16ps: x [ROWS, K] bf16 (K even), read a k pair (32 bits) at a time and
// broadcast against the weights' pairs.
template <int ROWS, bool LEAD, bool WHOLE, typename W>
inline void tile(const at::BFloat16* __restrict__ x, int64_t K, const W* __restrict__ w, int64_t p0,
                 int64_t p1, const Out& out, std::true_type /*dot*/) {
  __m512 acc[ROWS][2];
  begin_sums<ROWS, WHOLE>(acc, out);
  for (int64_t p = p0; p < p1; p++) {
    const W* wp = w + p * 2 * kPanel;
    prefetch<ROWS, LEAD>(wp);
    __m512bh v[2];
    load_pair(wp, v);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v[0], a);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v[1], a);
    }
  }
  end_sums<ROWS, WHOLE>(acc, out);
}

// ROWS = rows (1-8) of tile<ROWS, LEAD, WHOLE>.
template <bool LEAD, bool WHOLE, typename X, typename W, typename Dot>
inline void tile_of(int64_t rows, const X* x, int64_t K, const W* w, int64_t p0,
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
// rows, level at 20-32; from 33 rows (prefill) the sums' trips cost more than the overlap
// gains (64 rows: 5-10%, 512: 15%), so whole k there. The FMA loop, compute-bound from 9 rows on
// the Zen 4, measured 2-6% slower chunked and with even tiles there, and is unmeasured so on the
// Xeon where it is the default: it keeps tiles of 8 and the rest over the whole of k.
//
// bf16 weights at 2-8 rows (a verify of the CPU's default trees, the draft's steps, a batch's
// plain step) run chunked too, as one tile: what pays there is the lead tile's far prefetch
// (kFar pairs into L2), where a whole-k tile asks only kAhead pairs (2 KB) ahead into L1 and
// waits on memory once its multiply-adds per byte grow. The whole fused step on the Zen 4
// (scripts/probe_decoder_layers.py --linear-baseline, calls alternating, three runs at kv 150 and
// 600): 6-8 rows 1.10-1.36x faster, 2-5 rows level to 1.13x, 1 and 9 rows level, the same bits;
// without the far prefetch the chunked tile ran as slowly as before (3 / 6 / 8 rows 1.08 / 1.10
// / 1.37x behind). The default bf16 tree's round (6 rows), bench at both revisions alternating:
// 123.0 -> 136.9 tokens/s, verify 1.34 -> 1.29 plain steps. int8 weights keep whole-k tiles
// there: their chunks' conversion into L1 made 2-8 rows 0.81-0.89x.
constexpr int64_t kChunkedRows = 32;

// Rows of tile t of `tiles` over M rows: even sizes on vdpbf16ps, else 8 and the rest (m: the
// rows of the tiles before).
template <typename Dot>
inline int64_t tile_rows(int64_t t, int64_t tiles, int64_t m, int64_t M) {
  return Dot::value ? even_rows(t, tiles, M) : std::min<int64_t>(8, M - m);
}

// 2-32 rows on vdpbf16ps (int8 weights: 9-32): k in chunks, every tile in turn, the sums in a
// buffer between chunks.
// int8 weights: each chunk of the panel is made bf16 once, into an L1 buffer (exact: the values
// the one-row path makes in registers), which every tile multiplies as bf16 weights (the same
// vdpbf16ps chain over k per output as one row's), where tiles over the int8 panel would each
// convert it again (10 instructions a k pair of 32 columns, against a row's 2 vdpbf16ps).
// Measured on the Zen 4 EPYC (probe_bf16_linear.py --baseline): int8 Linears at 9 and 17 rows
// 6-12% faster than chunks that each tile converts, 32 rows 5% slower; at 64-512 rows whole-k
// tiles that convert for themselves were 15-20% faster than this, and on the FMA loop it was
// level: so only here.
template <typename W>
inline void chunked_rows(const at::BFloat16* x, int64_t M, int64_t K, const W* w, at::BFloat16* y,
                         int64_t N, int64_t cols, const float* scale) {
  constexpr int64_t kChunk = kChunkBytes / kPairBytes<at::BFloat16>;
  constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  const int64_t pairs = K / 2, tiles = (M + 7) / 8;
  alignas(64) __m512 sums[2 * kChunkedRows];
  alignas(64) at::BFloat16 converted[kInt8 ? kChunk * 2 * kPanel : 1];
  for (int64_t i = 0; i < 2 * M; i++) sums[i] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += kChunk) {
    const int64_t n = std::min(kChunk, pairs - p0);
    const at::BFloat16* chunk;  // k pairs p0..p0 + n of the panel, bf16
    if constexpr (kInt8) {
      for (int64_t p = 0; p < n; p++) {
        const int8_t* wp = w + (p0 + p) * 2 * kPanel;
        prefetch<1, true>(wp);
        __m512bh v[2];
        load_pair(wp, v);
        _mm512_store_si512(converted + p * 2 * kPanel, (__m512i)v[0]);
        _mm512_store_si512(converted + p * 2 * kPanel + kPanel, (__m512i)v[1]);
      }
      chunk = converted;
    } else {
      chunk = w + p0 * 2 * kPanel;
    }
    for (int64_t t = 0, m = 0; t < tiles; t++) {
      const int64_t rows = tile_rows<std::true_type>(t, tiles, m, M);
      const Out out{sums + 2 * m, nullptr, N, cols, nullptr};
      const at::BFloat16* xt = x + m * K + 2 * p0;
      if (t == 0 && !kInt8)  // the first tile leads the stream from memory
        tile_of<true, false>(rows, xt, K, chunk, 0, n, out, std::true_type{});
      else
        tile_of<false, false>(rows, xt, K, chunk, 0, n, out, std::true_type{});
      m += rows;
    }
  }
  for (int64_t r = 0; r < M; r++) store_row(y + r * N, sums[2 * r], sums[2 * r + 1], cols, scale);
}

template <typename X, typename W, typename Dot>
void rows_of(const X* x, int64_t M, int64_t K, const W* w, at::BFloat16* y, int64_t N,
             int64_t cols, const float* scale, Dot dot) {
  if constexpr (Dot::value) {
    constexpr int64_t kFirstChunked = std::is_same_v<W, int8_t> ? 9 : 2;
    if (M >= kFirstChunked && M <= kChunkedRows) return chunked_rows(x, M, K, w, y, N, cols, scale);
  }
  const int64_t tiles = (M + 7) / 8;
  for (int64_t t = 0, m = 0; t < tiles; t++) {
    const int64_t rows = tile_rows<Dot>(t, tiles, m, M);
    tile_of<false, true>(rows, x + m * K, K, w, 0, K / 2, Out{nullptr, y + m * N, N, cols, scale}, dot);
    m += rows;
  }
}

// On AMX (set_amx): `dot` calls whose K is a multiple of 32 multiply on the tiles. A panel's k pairs
// already are the layout TDPBF16PS takes for B: 16 k pairs of 16 columns is a tile of 16 rows of
// 64 bytes, 128 bytes apart in the panel (columns 0-15 at the panel's pair, 16-31 32 bf16 later);
// A is 16 rows (or fewer) of 32 k of x, rows K apart. Per tile row the hardware runs one chain over
// the k pairs in order, so a row's bits do not depend on the rows beside it, as in the loops above
// (not always the vdpbf16ps loop's bits: one choice a process). int8 weights: each 16 pairs of
// the panel are made bf16 (load_pair, exact) into a 2 KB buffer the tiles load from.
// Tiles: 0, 1 the sums of a block of 16 rows (columns 0-15, 16-31), 2 its x, 3, 4 the weights;
// 5, 6, 7 the same for the M % 16 rows after the blocks of 16. Up to 16 rows with bf16 weights (a
// decode step, a verify) run two panels at a time instead (amx_rows_two_panels).
std::atomic<bool> g_amx{false};
constexpr int64_t kTileK = 32;       // bf16 k of a tile row (64 bytes)
constexpr int64_t kTileRows = 16;

// Every tile 64 bytes a row; rows: sum_rows for tiles 0-1 (16: a block's sums; M: the second
// panel's sums of amx_rows_two_panels), 16 for tiles 2-4, last_rows (1 where 0: unused) for 5-7.
__attribute__((target("amx-tile"))) inline void configure_tiles(int64_t sum_rows, int64_t last_rows) {
  eagle::TileConfig cfg;
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = static_cast<uint8_t>(t < 2 ? sum_rows : t < 5 ? kTileRows : last_rows ? last_rows : 1);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The B tiles of k pairs kb * 16.. of a panel: straight from bf16 weights, or int8 ones made bf16
// into `buf` [16 pairs, 32 columns, 2].
inline const at::BFloat16* weight_tile(const at::BFloat16* wp, int64_t kb, at::BFloat16*) {
  return wp + kb * kTileRows * 2 * kPanel;
}

inline const at::BFloat16* weight_tile(const int8_t* wp, int64_t kb, at::BFloat16* buf) {
  const int8_t* w = wp + kb * kTileRows * 2 * kPanel;
#pragma GCC unroll 4
  for (int64_t p = 0; p < kTileRows; p++) {
    prefetch<1, true>(w + p * 2 * kPanel);
    __m512bh v[2];
    load_pair(w + p * 2 * kPanel, v);
    _mm512_store_si512(buf + p * 2 * kPanel, (__m512i)v[0]);
    _mm512_store_si512(buf + p * 2 * kPanel + kPanel, (__m512i)v[1]);
  }
  return buf;
}

// Sums of x rows [rows, K] over the panel wp to bf16 rows of y, on tiles C0 (columns 0-15), C1
// (16-31) and A (x), weights in 3 and 4; the weights 64 pairs ahead are asked for meanwhile. A
// macro: the tile intrinsics take the tile's number as a literal.
#define EAGLE_AMX_BLOCK(NAME, C0, C1, A)                                                                  \
  template <typename W>                                                                                 \
  __attribute__((target("amx-tile,amx-bf16"))) inline void NAME(                                       \
      const at::BFloat16* x, int64_t rows, int64_t K, const W* wp, at::BFloat16* y, int64_t N,          \
      int64_t cols, const float* scale, at::BFloat16* buf) {                                            \
    _tile_zero(C0);                                                                                     \
    _tile_zero(C1);                                                                                     \
    for (int64_t kb = 0; kb < K / kTileK; kb++) {                                                       \
      const at::BFloat16* b = weight_tile(wp, kb, buf);                                                 \
      if constexpr (std::is_same_v<W, at::BFloat16>) {                                                  \
        const char* ahead = reinterpret_cast<const char*>(b) + kFar * kPairBytes<at::BFloat16>;        \
        for (int64_t line = 0; line < kTileRows * kPairBytes<at::BFloat16>; line += 64)                 \
          _mm_prefetch(ahead + line, _MM_HINT_T0);                                                      \
      } else {                                                                                          \
        __asm__ volatile("" ::: "memory"); /* the tile loads read buf: its stores go first */          \
      }                                                                                                 \
      _tile_loadd(A, x + kb * kTileK, K * sizeof(at::BFloat16));                                        \
      _tile_loadd(3, b, kPairBytes<at::BFloat16>);                                                      \
      _tile_loadd(4, b + 16 * 2, kPairBytes<at::BFloat16>);                                             \
      _tile_dpbf16ps(C0, A, 3);                                                                         \
      _tile_dpbf16ps(C1, A, 4);                                                                         \
    }                                                                                                   \
    alignas(64) float sums[kTileRows][kPanel];                                                          \
    _tile_stored(C0, sums[0], kPanel * sizeof(float));                                                  \
    _tile_stored(C1, sums[0] + 16, kPanel * sizeof(float));                                             \
    for (int64_t r = 0; r < rows; r++)                                                                  \
      store_row(y + r * N, _mm512_load_ps(sums[r]), _mm512_load_ps(sums[r] + 16), cols, scale);         \
  }
EAGLE_AMX_BLOCK(amx_block, 0, 1, 2)
EAGLE_AMX_BLOCK(amx_last_block, 5, 6, 7)
#undef EAGLE_AMX_BLOCK

// Up to 16 rows of x (a decode step's one, a verify's tree) over two panels at once (bf16 weights):
// sums in tiles 5, 6 (panel wp0) and 0, 1 (wp1), x in 7, weights in 3, 4 and 2 (tile 3 loaded twice
// a step: eight tiles hold no more), tiles 0, 1 and 5-7 `rows` rows (configure_tiles(M, M)). Each
// output is still one chain over k in order, so the bits are amx_last_block's and a verify's rows
// still equal one-row steps'. Two panels' weights stream at once where one panel's did: measured on
// the Xeon with AMX (2 threads) against one panel at a time, alternating call by call in one
// process (scripts/probe_decoder_layers.py --linear-baseline, kv 200 and 600, the same bits): a
// decode step's fused layers on Llama-3.2-1B's shape 5% faster, Qwen2.5-0.5B's 2.5-3%,
// Qwen3-0.6B's 2%, SmolLM2-135M's 0.6%; per Linear (probe_bf16_linear.py --baseline) Llama-3.2-1B's
// shapes 5-8% (its lm_head, 128256x2048, 4.8%), SmolLM2's level to 5%. At 7-16 rows (a verify of
// the default tree: 7 rows without its n-gram branch's, 11 with) the fused layers 1.4-4.2% faster
// on SmolLM2-135M and 3.4-7% on Llama-3.2-1B's, Qwen3-0.6B's and Qwen2.5-0.5B's shapes (kv 200 and
// 600, the same bits; results/probe_amx_two_panels_verify_*_xeon_amx.json), where a verify's
// Linears then cost about what a decode step's do. int8 weights keep one panel at a time: two (each
// made bf16 into its own buffer) were 2-5% slower at 1-11 rows.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_rows_two_panels(
    const at::BFloat16* x, int64_t rows, int64_t K, const at::BFloat16* wp0, const at::BFloat16* wp1,
    at::BFloat16* y0, at::BFloat16* y1, int64_t N, int64_t cols1) {
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kb = 0; kb < K / kTileK; kb++) {
    const at::BFloat16* b0 = wp0 + kb * kTileRows * 2 * kPanel;
    const at::BFloat16* b1 = wp1 + kb * kTileRows * 2 * kPanel;
    // the two panels' lines asked for in turn: a panel's 32 prefetches and then the other's made
    // the Llama-3.2-1B step 3.5-4% slower (probe_decoder_layers --linear-baseline, the same bits)
    const char* ahead0 = reinterpret_cast<const char*>(b0) + kFar * kPairBytes<at::BFloat16>;
    const char* ahead1 = reinterpret_cast<const char*>(b1) + kFar * kPairBytes<at::BFloat16>;
    for (int64_t line = 0; line < kTileRows * kPairBytes<at::BFloat16>; line += 64) {
      _mm_prefetch(ahead0 + line, _MM_HINT_T0);
      _mm_prefetch(ahead1 + line, _MM_HINT_T0);
    }
    _tile_loadd(7, x + kb * kTileK, K * sizeof(at::BFloat16));
    _tile_loadd(3, b0, kPairBytes<at::BFloat16>);
    _tile_loadd(4, b0 + 16 * 2, kPairBytes<at::BFloat16>);
    _tile_loadd(2, b1, kPairBytes<at::BFloat16>);
    _tile_dpbf16ps(5, 7, 3);
    _tile_dpbf16ps(6, 7, 4);
    _tile_dpbf16ps(0, 7, 2);
    _tile_loadd(3, b1 + 16 * 2, kPairBytes<at::BFloat16>);
    _tile_dpbf16ps(1, 7, 3);
  }
  alignas(64) float sums[4][kTileRows][kPanel / 2];  // tiles 5, 6, 0, 1: `rows` rows of 16 sums
  _tile_stored(5, sums[0], 64);
  _tile_stored(6, sums[1], 64);
  _tile_stored(0, sums[2], 64);
  _tile_stored(1, sums[3], 64);
  for (int64_t r = 0; r < rows; r++) {
    store_row(y0 + r * N, _mm512_load_ps(sums[0][r]), _mm512_load_ps(sums[1][r]), kPanel, nullptr);
    store_row(y1 + r * N, _mm512_load_ps(sums[2][r]), _mm512_load_ps(sums[3][r]), cols1, nullptr);
  }
}

template <typename W>
__attribute__((target("amx-tile,amx-bf16"))) void amx_panels(const eagle::LinearCall& c, int64_t p0, int64_t p1) {
  const auto* x = static_cast<const at::BFloat16*>(c.x);
  auto* y = static_cast<at::BFloat16*>(c.y);
  const int64_t full = c.M / kTileRows, last = c.M % kTileRows;
  alignas(64) at::BFloat16 buf[std::is_same_v<W, int8_t> ? kTileRows * 2 * kPanel : 1];
  if constexpr (std::is_same_v<W, at::BFloat16>) {
    if (c.M <= kTileRows) {  // a decode step or a verify: two panels at a time
      configure_tiles(c.M, c.M);
      const W* w = static_cast<const W*>(c.w);
      int64_t p = p0;
      for (; p + 1 < p1; p += 2)
        amx_rows_two_panels(x, c.M, c.K, w + p * c.K * kPanel, w + (p + 1) * c.K * kPanel, y + p * kPanel,
                            y + (p + 1) * kPanel, c.N, std::min(kPanel, c.N - (p + 1) * kPanel));
      if (p < p1)
        amx_last_block(x, c.M, c.K, w + p * c.K * kPanel, y + p * kPanel, c.N, std::min(kPanel, c.N - p * kPanel),
                       nullptr, buf);
      return;
    }
  }
  configure_tiles(kTileRows, last);
  for (int64_t p = p0; p < p1; p++) {
    const int64_t cols = std::min(kPanel, c.N - p * kPanel);
    const float* s = c.scale ? c.scale + p * kPanel : nullptr;
    const W* wp = static_cast<const W*>(c.w) + p * c.K * kPanel;
    for (int64_t b = 0; b < full; b++)
      amx_block(x + b * kTileRows * c.K, kTileRows, c.K, wp, y + b * kTileRows * c.N + p * kPanel, c.N,
                   cols, s, buf);
    if (last)
      amx_last_block(x + full * kTileRows * c.K, last, c.K, wp, y + full * kTileRows * c.N + p * kPanel, c.N,
                   cols, s, buf);
  }
}

// set_amx(on): `dot` calls multiply on AMX from now on (where eagle::amx_usable; returns whether
// they do).
bool set_amx(bool on) {
  g_amx = on && eagle::amx_usable();
  return g_amx;
}

// All rows of a LinearCall over one panel wp, to its columns of y (cols of them; s: their int8
// scales, else nullptr), on vdpbf16ps (dot) or the FMA loop.
template <typename W>
inline void panel_rows(const eagle::LinearCall& c, const W* wp, at::BFloat16* y, int64_t cols, const float* s) {
  if (c.dot)
    rows_of(static_cast<const at::BFloat16*>(c.x), c.M, c.K, wp, y, c.N, cols, s, std::true_type{});
  else
    rows_of(static_cast<const float*>(c.x), c.M, c.K, wp, y, c.N, cols, s, std::false_type{});
}

#else  // the AVX2 build (bf16_linear.load: a CPU without AVX512-BF16)

// The FMA loop on 8-float vectors: no vdpbf16ps (`dot` is refused), no AMX. Each output is the
// same fp32 FMA chain over k = 0..K-1 from zero as the AVX-512 loop's, so a verify's rows equal
// one-row steps' bit for bit here too. A k pair of 8 columns is one 32-byte load of bf16 pairs
// (16 bytes of int8), made fp32 with a shift and a mask (int8: load_pair8). A tile of up to 4 rows
// runs the panel's 4 vectors (32 columns) together, a vector's weights made fp32 at a time for
// every row. Up to 4 rows, one tile runs all of k. More rows run k in chunks of kChunk pairs (4 KB
// of bf16 panel: L1) that every tile takes in turn, the first asking for the panel ahead, the sums
// in a buffer between chunks (exact fp32: still one chain over k from zero per output): the panel
// streams from memory once whatever the rows, and the FMAs of the tiles after the first run on
// what L1 holds while the stream goes on. Measured on a 2-core AMD EPYC Zen 2 against tiles of
// 4-5 rows that ran the panel's two 16-column halves one after the other (scripts/
// probe_bf16_linear.py --baseline, results/probe_bf16_linear_amd_avx2_chunks.json): the lm_head
// at 4 / 5 / 6 / 8 / 16 rows 23 / 19 / 28 / 23 / 14% faster, 1.11 / 1.16 / 1.21 / 1.57x one row
// (the halves: 1.45 / 1.42 / 1.69 / 2.04x: each half's pass stalled on the stream behind its
// FMAs); 1-3 rows level or a little faster, 32-512 within 5%. int8 weights convert in every tile
// (5 instructions a 16 weights): 2-4 and 6 rows 3-15% faster, 8-16 level, 5 rows 11% slower (4 + 1
// rows convert twice). From kLargeRows rows (prefill chunks, batches' verifies) large_panel_rows
// instead: the panel made fp32 once, 6 x 16 tiles over it.
std::atomic<bool> g_amx{false};  // never on: no AMX in this build
constexpr int64_t kMaxTileRows = 4;
constexpr int64_t kChunk = 32;
constexpr int64_t kBlockRows = 16;  // rows whose sums wait in a buffer together (more: blocks)

template <int ROWS>
constexpr int64_t kAhead = ROWS == 1 ? 8 : 64;  // k pairs prefetched ahead (bf16 pairs' bytes)

inline void load_pair8(const at::BFloat16* wp, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// int8: 16 bytes widened to 16-bit pairs; each half of a pair sign-extended by a multiply-add with
// (1, 0) or (0, 1) (one instruction where shifts take two: 3 rows 8-16% faster, the Zen 2 probe)
inline void load_pair8(const int8_t* wp, __m256& even, __m256& odd) {
  const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
  even = _mm256_cvtepi32_ps(_mm256_madd_epi16(v, _mm256_set1_epi32(1)));
  odd = _mm256_cvtepi32_ps(_mm256_madd_epi16(v, _mm256_set1_epi32(0x10000)));
}

// A row's NV * 8 sums to its first `cols` bf16 outputs at y, times the int8 scales s (nullptr for
// bf16 weights), rounded once.
template <int NV>
inline void store_row8(at::BFloat16* y, const __m256 (&sum)[NV], int64_t cols, const float* s) {
  alignas(32) at::BFloat16 out[NV * 8];
#pragma GCC unroll 4
  for (int v = 0; v < NV; v++)
    eagle::store8(out + v * 8, s ? _mm256_mul_ps(sum[v], _mm256_loadu_ps(s + v * 8)) : sum[v]);
  std::memcpy(y, out, cols * sizeof(at::BFloat16));
}

// The panel's 32 columns for ROWS rows of x [ROWS, K] (fp32, K even) over k pairs p0..p1, the sums
// from and back to s [ROWS, 32] (fp32). LEAD: the tile that reads the panel first asks for it
// kAhead pairs ahead.
template <int ROWS, bool LEAD, typename W>
inline void tile8(const float* __restrict__ x, int64_t K, const W* __restrict__ w, int64_t p0, int64_t p1,
                  float* __restrict__ s) {
  constexpr int64_t kVec = 16;  // a vector's k pair: 16 weights
  __m256 acc[ROWS][4];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) acc[r][v] = _mm256_load_ps(s + r * kPanel + v * 8);
  for (int64_t p = p0; p < p1; p++) {
    const W* wp = w + p * 2 * kPanel;
    if constexpr (LEAD) {
      const char* ahead = reinterpret_cast<const char*>(wp) + kAhead<ROWS> * 2 * kPanel * sizeof(at::BFloat16);
#pragma GCC unroll 2
      for (int64_t line = 0; line < 2 * kPanel * static_cast<int64_t>(sizeof(W)); line += 64)
        _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    __m256 a[ROWS], b[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++)
      a[r] = _mm256_broadcast_ss(x + r * K + 2 * p), b[r] = _mm256_broadcast_ss(x + r * K + 2 * p + 1);
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
      __m256 even, odd;
      load_pair8(wp + v * kVec, even, odd);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; r++)  // k = 2p, then 2p + 1: one FMA chain over k per output
        acc[r][v] = _mm256_fmadd_ps(b[r], odd, _mm256_fmadd_ps(a[r], even, acc[r][v]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) _mm256_store_ps(s + r * kPanel + v * 8, acc[r][v]);
}

template <bool LEAD, typename W>
inline void tile8_of(int64_t rows, const float* x, int64_t K, const W* w, int64_t p0, int64_t p1, float* s) {
  switch (rows) {
    case 4: tile8<4, LEAD>(x, K, w, p0, p1, s); break;
    case 3: tile8<3, LEAD>(x, K, w, p0, p1, s); break;
    case 2: tile8<2, LEAD>(x, K, w, p0, p1, s); break;
    default: tile8<1, LEAD>(x, K, w, p0, p1, s); break;
  }
}

// Many rows (prefill chunks, a batch's verify) are compute-bound: there the panel is made fp32
// once for all the rows, into a buffer [K, 32] that stays in L2, and tiles of 6 rows x 16
// columns run over all of k from it: 12 accumulators, the two weight vectors and a broadcast fit
// the 16 registers (the 4 x 32 tiles above spill), 12 FMAs a k against 2 loads of weights and 6
// broadcasts, no conversions. Each output is still one fp32 FMA chain over k from zero: the bits
// of the tiles above, and of a one-row step.
template <typename W>
constexpr int64_t kLargeRows = std::is_same_v<W, int8_t> ? 12 : 32;

template <int ROWS>
inline void tile16(const float* __restrict__ x, int64_t K, const float* __restrict__ w, at::BFloat16* y,
                   int64_t N, int64_t cols, const float* s) {
  __m256 acc[ROWS][2];
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 6  // every acc[r] a register: a loop over r would keep them on the stack
  for (int r = 0; r < ROWS; r++) store_row8(y + r * N, acc[r], cols, s);
}

template <typename W>
inline void large_panel_rows(const eagle::LinearCall& c, const W* wp, at::BFloat16* y, int64_t cols,
                             const float* s) {
  const auto* x = static_cast<const float*>(c.x);
  const int64_t K = c.K;
  thread_local std::vector<float> panel;  // [K, 32]: w[n, k] at k * 32 + n
  panel.resize(K * kPanel);
  float* w = panel.data();
  for (int64_t p = 0; p < K / 2; p++)
    for (int v = 0; v < 4; v++) {
      __m256 even, odd;
      load_pair8(wp + p * 2 * kPanel + v * 16, even, odd);
      _mm256_storeu_ps(w + 2 * p * kPanel + v * 8, even);
      _mm256_storeu_ps(w + (2 * p + 1) * kPanel + v * 8, odd);
    }
  for (int64_t m = 0; m < c.M; m += 6) {
    const int64_t rows = std::min<int64_t>(6, c.M - m);
    for (int64_t h = 0; h < 2 && 16 * h < cols; h++) {
      const float* xm = x + m * K;
      at::BFloat16* ym = y + m * c.N + 16 * h;
      const int64_t hc = std::min<int64_t>(16, cols - 16 * h);
      const float* sh = s ? s + 16 * h : nullptr;
      switch (rows) {
        case 6: tile16<6>(xm, K, w + 16 * h, ym, c.N, hc, sh); break;
        case 5: tile16<5>(xm, K, w + 16 * h, ym, c.N, hc, sh); break;
        case 4: tile16<4>(xm, K, w + 16 * h, ym, c.N, hc, sh); break;
        case 3: tile16<3>(xm, K, w + 16 * h, ym, c.N, hc, sh); break;
        case 2: tile16<2>(xm, K, w + 16 * h, ym, c.N, hc, sh); break;
        default: tile16<1>(xm, K, w + 16 * h, ym, c.N, hc, sh); break;
      }
    }
  }
}

// All rows of a LinearCall over one panel wp, to its columns of y (as the AVX-512 build's): blocks
// of up to kBlockRows rows, each over k in chunks (one chunk: all of k, where a tile holds them);
// from kLargeRows rows large_panel_rows.
template <typename W>
inline void panel_rows(const eagle::LinearCall& c, const W* wp, at::BFloat16* y, int64_t cols, const float* s) {
  if (c.M >= kLargeRows<W>) return large_panel_rows(c, wp, y, cols, s);
  const auto* x = static_cast<const float*>(c.x);
  const int64_t pairs = c.K / 2;
  alignas(32) float sums[kBlockRows * kPanel];
  for (int64_t m0 = 0; m0 < c.M; m0 += kBlockRows) {
    const int64_t M = std::min(kBlockRows, c.M - m0);
    const int64_t chunk = M <= kMaxTileRows ? pairs : kChunk;
    std::memset(sums, 0, M * kPanel * sizeof(float));
    for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
      const int64_t p1 = std::min(pairs, p0 + chunk);
      for (int64_t m = 0; m < M; m += kMaxTileRows) {
        const int64_t rows = std::min(kMaxTileRows, M - m);
        const float* xm = x + (m0 + m) * c.K;
        if (m == 0)
          tile8_of<true>(rows, xm, c.K, wp, p0, p1, sums + m * kPanel);
        else
          tile8_of<false>(rows, xm, c.K, wp, p0, p1, sums + m * kPanel);
      }
    }
    for (int64_t r = 0; r < M; r++) {
      __m256 sum[4];
      for (int v = 0; v < 4; v++) sum[v] = _mm256_load_ps(sums + r * kPanel + v * 8);
      store_row8(y + (m0 + r) * c.N, sum, cols, s);
    }
  }
}

bool set_amx(bool) { return false; }
#endif

// Panels p0..p1 of a LinearCall over a packed weight of W's dtype [panels, K / 2, 32, 2] (K even):
// what each thread of a parallel region computes (eagle::LinearPanels).
template <typename W>
void panels(const eagle::LinearCall& c, int64_t p0, int64_t p1) {
#if defined(__AVX512BF16__)
  if (c.dot && c.K % kTileK == 0 && g_amx.load(std::memory_order_relaxed)) return amx_panels<W>(c, p0, p1);
#endif
  const W* w = static_cast<const W*>(c.w);
  auto* y = static_cast<at::BFloat16*>(c.y);
  for (int64_t p = p0; p < p1; p++) {
    const int64_t cols = std::min(kPanel, c.N - p * kPanel);
    panel_rows(c, w + p * c.K * kPanel, y + p * kPanel, cols, c.scale ? c.scale + p * kPanel : nullptr);
  }
}

// y = x @ W.T (times the column scales for int8 W) through the packed weight wp [panels, K / 2,
// 32, 2] of W's dtype; `name` for the errors.
template <typename W>
at::Tensor linear(const char* name, const at::Tensor& x_in, const at::Tensor& wp, const float* scale,
                  int64_t N, bool dot) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, name, ": bf16 inputs only, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.device().is_cpu() && wp.device().is_cpu(), name, ": CPU tensors only");
#if !defined(__AVX512BF16__)
  TORCH_CHECK(!dot, name, ": dot products (vdpbf16ps, AMX tiles) need a CPU with AVX512-BF16; this build has "
              "the FMA loop only");
#endif
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(wp.dim() == 4 && wp.size(1) == (K + 1) / 2 && wp.size(2) == kPanel && wp.size(3) == 2 &&
                  wp.size(0) * kPanel >= N && wp.is_contiguous(),
              name, ": packed weight ", wp.sizes(), " does not hold ", N, " outputs of ", K,
              " inputs in 32-column panels of k pairs");
  // inputs read by every panel: fp32 for the FMAs, bf16 for vdpbf16ps; an odd K gets a zero
  // column to meet the weight's zero row
  const at::Tensor padded = K % 2 ? at::constant_pad_nd(x_in, {0, 1}) : x_in;
  const at::Tensor x = (dot ? padded : padded.to(at::kFloat)).contiguous();
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x_in.options());
  const int64_t M = K == 0 ? 0 : x_in.numel() / K;
  if (M == 0 || N == 0) return y;
  const eagle::LinearCall call{x.data_ptr(), M, K + K % 2, wp.data_ptr<W>(), scale, y.data_ptr(), N, dot};
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) { panels<W>(call, begin, end); });
  return y;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, bool dot) {
  TORCH_CHECK(wp.scalar_type() == at::kBFloat16, "bf16_linear: bf16 packed weight only, got ", wp.scalar_type());
  return linear<at::BFloat16>("bf16_linear", x, wp, nullptr, N, dot);
}

// scale: fp32 [panels * 32], zero-padded past N (pack_int8).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, int64_t N,
                       bool dot) {
  TORCH_CHECK(wp.scalar_type() == at::kChar, "int8_linear: int8 packed weight only, got ", wp.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous() &&
                  scale.size(0) == wp.size(0) * kPanel && scale.device().is_cpu(),
              "int8_linear: scale must be a contiguous fp32 CPU vector of ", wp.size(0) * kPanel,
              " (a packed panel's 32 columns each), got ", scale.scalar_type(), " ", scale.sizes());
  return linear<int8_t>("int8_linear", x, wp, scale.data_ptr<float>(), N, dot);
}

// The address of panels<W> (eagle::LinearPanels) for bf16 or int8 weights, for decoder_layers.cpp.
int64_t bf16_linear_panels(bool int8) {
  const eagle::LinearPanels f = int8 ? &panels<int8_t> : &panels<at::BFloat16>;
  return reinterpret_cast<int64_t>(f);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("bf16_linear(Tensor x, Tensor packed_weight, int out_features, bool dot=False) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed_weight, Tensor scale, int out_features, bool dot=False) -> Tensor");
  m.def("bf16_linear_panels(bool int8) -> int", &bf16_linear_panels);
  m.def("bf16_linear_set_amx(bool on) -> bool", &set_amx);
  m.def("bf16_linear_amx_on() -> bool", [] { return g_amx.load(); });
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int8_linear", &int8_linear);
}
