// out[b, h, t] = softmax(q[b, h, t] . K[b, h / G]^T / sqrt(D) + bias[b, 0, t]) V[b, h / G] for the
// few query rows of a decode step (1) or a verify (a tree's nodes), fp32 on AVX2 + FMA, GQA
// (G = heads / kv_heads query heads read one kv head). D = 64, 128 or 256 (the head sizes of the
// targets this runs: Llama-family and Qwen2 heads of 64, Qwen3's of 128, Gemma's of 256; other sizes
// go to SDPA): each function below is a template on D, the op and the fused layers (64 and 128
// only) pick the instance (with_head_size). A bf16 call
// reads its bf16 K and V in place, widens each block of keys or values to fp32 once for all its
// query rows, and computes as an fp32 call does; its output is rounded to bf16 once.
//
// Why not SDPA: torch's CPU flash kernel spends ~85 us on one query row over 512 keys (9 heads,
// D 64, AMD EPYC AVX2, 2 threads) and ~210 us on four, where reading K and V once takes a few us;
// a step calls it 30 times. Here each (batch, head) is one task: its rows' scores, softmax and
// weighted sum of V, with K and V read from the cache in place (strided views). A row's result
// never depends on how many rows came with it (each row runs the same loops in the same order),
// so a verify's rows equal one-row steps', as with the AVX2 Linear kernel. bf16 calls may compute
// their scores on vdpbf16ps (attend_rows_dot, the default on AMD CPUs with AVX512-BF16) or on AMX
// tiles (attend_rows_amx, opt-in) instead: below, functions built for AVX-512 by their target
// attributes, the rest of the file for AVX2. A prefill's causal attention from
// slot 0 has its own op, causal_attention (below): hundreds of rows, blocked for throughput.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "avx2_math.h"
#include "kernel_calls.h"

namespace {

constexpr int64_t kKeysAhead = 64;  // keys whose rows are asked for ahead of the scores (prefetch_rows)

// One cache row (D values) as fp32: copied, or widened from bf16 (a bf16 is the high half of the
// fp32 of the same value, so exactly).
template <int D>
inline void row_as_fp32(const float* src, float* dst) { std::memcpy(dst, src, D * sizeof(float)); }
template <int D>
inline void row_as_fp32(const at::BFloat16* src, float* dst) {
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, eagle::load8(src + d));
}

// n keys' (or values') rows of the cache from src (rows `stride` apart) as fp32, followed by zero
// rows up to `rows`: a full block of an fp32 cache in place, else copied (widened from bf16) into
// buf, once for all the query rows that read them. Returns the rows and their stride.
template <int D, typename KV>
inline std::pair<const float*, int64_t> block_as_fp32(const KV* src, int64_t n, int64_t rows, int64_t stride,
                                                      float* buf) {
  if constexpr (std::is_same_v<KV, float>) {
    if (n == rows) return {src, stride};
  }
  for (int64_t i = 0; i < n; i++) row_as_fp32<D>(src + i * stride, buf + i * D);
  std::fill(buf + n * D, buf + rows * D, 0.f);
  return {buf, D};
}

// Ask for n cache rows (`stride` apart) from `rows` on into L2 (a hint). A step's K and V come from
// memory (the Linears streamed megabytes of weights since the last step read them), and the
// hardware's prefetcher alone was slow at it: a one-row call over 1,200 slots, 30 layers' caches
// in turn with 64 MB read between steps, 154 us a layer on the loops; 133 with K asked for
// kKeysAhead keys ahead and V as K goes (2-core Zen 4; scripts/probe_avx2_attention.py --cold).
template <int D, typename KV>
inline void prefetch_rows(const KV* rows, int64_t n, int64_t stride) {
  for (int64_t i = 0; i < n; i++) {
    const char* row = reinterpret_cast<const char*>(rows + i * stride);
    for (int64_t line = 0; line < D * static_cast<int64_t>(sizeof(KV)); line += 64)
      _mm_prefetch(row + line, _MM_HINT_T1);
  }
}

// Before the scores of keys j..j+n of those up to `end`, from key `start` on: K's rows kKeysAhead keys
// on (from `start` at j = start), and, unless v is null, these keys' V rows, which P V reads after
// every score.
template <int D, typename KV>
inline void prefetch_ahead(const KV* k, const KV* v, int64_t j, int64_t n, int64_t end, int64_t stride,
                           int64_t start = 0) {
  if (j == start) prefetch_rows<D>(k + start * stride, std::min(end - start, kKeysAhead), stride);
  if (j + kKeysAhead < end) prefetch_rows<D>(k + (j + kKeysAhead) * stride, std::min(n, end - j - kKeysAhead), stride);
  if (v) prefetch_rows<D>(v + j * stride, n, stride);
}

// The slots a (batch, kv head)'s rows read, from slot 0: one past the last slot that any of its T
// bias rows (bias_stride apart, S slots each) leaves unmasked (model.attn_bias: -inf), at least 1.
// A batch's rows share one S (its longest row's length, rounded up: generate.kv_len_for), so a
// shorter row's tail is masked, and a row's masked slots add exact zeros to its sums (below): the
// slots past the last unmasked one are left unread, with the same result bit for bit. At batch 32
// on MT-bench prompts the rows' lengths spread over hundreds of slots; served requests, which join
// a running batch at any length, spread wider.
template <typename KV>
int64_t live_slots(const KV* bias, int64_t bias_stride, int64_t T, int64_t S) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  int64_t live = 1;
  for (int64_t t = 0; t < T && live < S; t++) {
    const KV* b = bias + t * bias_stride;
    int64_t j = S;
    while (j >= live + 8 && _mm256_movemask_ps(_mm256_cmp_ps(eagle::load8(b + j - 8), neg_inf, _CMP_EQ_OQ)) == 0xFF)
      j -= 8;
    while (j > live && static_cast<float>(b[j - 1]) == -INFINITY) j--;
    live = std::max(live, j);
  }
  return live;
}

// Rows r0..r1 of one (batch, kv head): row r is query head g = r / T of the kv head's group at
// position t = r % T. q, bias and out in the cache's dtype KV: q and the bias widened to fp32 as
// they are read (exactly), each output rounded once as it is written. Scores first (each block of 8 keys, read from the cache once, serves every
// row from L1), then each row's softmax, then sum_j p_j v_j over blocks of keys (again each V
// block read once for all rows). A row's arithmetic is the same whichever rows come with it. The
// registers hold 64 of d at a time (a head of 128 runs its d in two passes, each score and each
// output value the same chain as in one).
template <int D, typename KV>
void attend_rows(const KV* q, const KV* k, const KV* v, int64_t kv_stride, const KV* bias,
                 int64_t bias_stride, int64_t T, int64_t S, int64_t r0, int64_t r1, float scale, float* scores, KV* out,
                 int64_t out_h, int64_t out_t) {
  const int64_t R = r1 - r0;
  std::vector<float> qs(R * D), sums(R, 0.f);
  for (int64_t r = 0; r < R; r++)
    for (int64_t d = 0; d < D; d++) qs[r * D + d] = static_cast<float>(q[(r0 + r) * D + d]) * scale;
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  alignas(32) float lanes[8];
  std::vector<float> buf(16 * D);  // a block of keys or values as fp32 (block_as_fp32)
  // Keys in blocks of 8 from slot 0, the last one zero-padded: a slot's score is the same
  // whatever S is, and (below) the softmax's sum and the weighted sum of V run in slot order,
  // where a masked slot adds an exact 0: a row's result does not change with masked slots
  // between or after the ones it attends (a plain step reads fewer slots than a verify of the
  // same row, and a tree's path has its siblings between its nodes).
  for (int64_t j = 0; j < S; j += 8) {
    const int64_t n = std::min<int64_t>(8, S - j);
    prefetch_ahead<D>(k, v, j, n, S, kv_stride);
    const auto [kj, k_stride] = block_as_fp32<D>(k + j * kv_stride, n, 8, kv_stride, buf.data());
    for (int64_t r = 0; r < R; r++) {
      // 64 of q's d in registers, four keys at a time (8 + 4 registers): one load a fused multiply-add
      const float* qr = qs.data() + r * D;
      __m128 four[2];
      for (int half = 0; half < 2; half++) {
        __m256 acc[4];
        for (int c = 0; c < D / 64; c++) {
          __m256 qv[8];
          for (int d = 0; d < 8; d++) qv[d] = _mm256_loadu_ps(qr + 64 * c + 8 * d);
          for (int i = 0; i < 4; i++) {
            const float* ki = kj + (4 * half + i) * k_stride + 64 * c;
            __m256 a = c == 0 ? _mm256_mul_ps(qv[0], _mm256_loadu_ps(ki))
                              : _mm256_fmadd_ps(qv[0], _mm256_loadu_ps(ki), acc[i]);
            for (int d = 1; d < 8; d++) a = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(ki + 8 * d), a);
            acc[i] = a;
          }
        }
        const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        four[half] = _mm_add_ps(_mm256_castps256_ps128(s0123), _mm256_extractf128_ps(s0123, 1));
      }
      const KV* b = bias + ((r0 + r) % T) * bias_stride + j;
      const __m256 dots = _mm256_insertf128_ps(_mm256_castps128_ps256(four[0]), four[1], 1);
      if (n == 8) {
        _mm256_storeu_ps(scores + r * S + j, _mm256_add_ps(dots, eagle::load8(b)));
      } else {  // the last, partial block
        _mm256_store_ps(lanes, dots);
        for (int64_t i = 0; i < n; i++) scores[r * S + j + i] = lanes[i] + static_cast<float>(b[i]);
      }
    }
  }
  for (int64_t r = 0; r < R; r++) {  // p = exp(s - max), exactly 0 where the bias masks the slot
    float* p = scores + r * S;
    // the row's max, 8 lanes at a time (a scalar loop was a chain of S compares): the same value
    // in any order (-0 and +0 aside, which give the same exp(s - m); a NaN score makes the row
    // NaN either way)
    __m256 lanes_max = neg_inf;
    int64_t i0 = 0;
    for (; i0 + 8 <= S; i0 += 8) lanes_max = _mm256_max_ps(lanes_max, _mm256_loadu_ps(p + i0));
    _mm256_store_ps(lanes, lanes_max);
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = std::max(m, lanes[l]);
    for (; i0 < S; i0++) m = std::max(m, p[i0]);
    const __m256 vm = _mm256_set1_ps(m);
    for (int64_t i = 0; i < S; i += 8) {
      const int64_t n = std::min<int64_t>(8, S - i);
      if (n < 8) {  // the last, partial block: masked (-inf) lanes after it
        for (int64_t l = 0; l < 8; l++) lanes[l] = l < n ? p[i + l] : -INFINITY;
      }
      const __m256 s = _mm256_loadu_ps(n == 8 ? p + i : lanes);
      const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(s, neg_inf, _CMP_EQ_OQ), eagle::exp8(_mm256_sub_ps(s, vm)));
      if (n == 8) {
        _mm256_storeu_ps(p + i, e);
      } else {
        _mm256_store_ps(lanes, e);
        for (int64_t l = 0; l < n; l++) p[i + l] = lanes[l];
      }
    }
  }
  std::vector<float> o(R * D, 0.f);
  constexpr int64_t kBlock = 16;  // keys per V block: 4 KB at D 64, stays in L1 across the rows
  for (int64_t j0 = 0; j0 < S; j0 += kBlock) {
    const int64_t j1 = std::min(S, j0 + kBlock);
    const auto [vb, v_stride] = block_as_fp32<D>(v + j0 * kv_stride, j1 - j0, j1 - j0, kv_stride, buf.data());
    for (int64_t r = 0; r < R; r++) {
      const float* p = scores + r * S;
      for (int c = 0; c < D / 64; c++) {  // 64 of d in registers at a time
        float* orow = o.data() + r * D + 64 * c;
        __m256 acc[8];
        for (int d = 0; d < 8; d++) acc[d] = _mm256_loadu_ps(orow + 8 * d);
        for (int64_t jj = j0; jj < j1; jj++) {
          const __m256 pj = _mm256_set1_ps(p[jj]);  // 0 at masked slots: adds nothing
          const float* vj = vb + (jj - j0) * v_stride + 64 * c;
          for (int d = 0; d < 8; d++) acc[d] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * d), acc[d]);
        }
        for (int d = 0; d < 8; d++) _mm256_storeu_ps(orow + 8 * d, acc[d]);
      }
      // the softmax's sum in slot order too: where the attended slots sit (a tree's path has
      // masked siblings between its nodes, a plain step none) does not change it
      float sum = sums[r];
      for (int64_t jj = j0; jj < j1; jj++) sum += p[jj];
      sums[r] = sum;
    }
  }
  for (int64_t r = 0; r < R; r++) {
    const __m256 inv = _mm256_set1_ps(1.f / sums[r]);
    const int64_t g = (r0 + r) / T, t = (r0 + r) % T;
    KV* dst = out + g * out_h + t * out_t;
    for (int d = 0; d < D; d += 8) eagle::store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o.data() + r * D + d), inv));
  }
}

// bf16 calls' scores on AVX-512 instead of the loops above (one choice a process, set_bf16_scores;
// EAGLE_CPU_ATTENTION): with vdpbf16ps ("dot", AVX512-BF16: the default on AMD CPUs with it)
// or on AMX tiles ("amx", opt-in). On the loops each added query row costs its own pass over K
// (~18 core-cycles a head-slot, about twice what their FMAs need). 2 threads, 9 heads over 3,
// 1,024 slots, cache warm: on a Zen 4 1 / 4 / 11 query rows took 45 / 93 / 195 us on vdpbf16ps
// against 62 / 150 / 341 on the loops; on a Xeon with AMX one row 72 us and six 244 on the loops.
//   dot: K in blocks of 16 keys packed as vdpbf16ps's B operand (kp[p] = the 16 keys' d pair p,
// 16 x 32 pairs transposed once for every row of the call), each row's score for the 16 keys one
// chain of 32 vdpbf16ps over the d pairs (q's pair broadcast), up to 8 rows side by side.
//   amx: C[slot][row] = K's rows (the A tile, straight from the cache) times Q's rows (the B tile,
// made once a call), 16 slots at a time, transposed into the rows' scores; a tile element is a
// chain over the head's D values, the same whichever slot or row it is.
//   Then the softmax and P V as the loops do, on 16 lanes: P V (and the weights' sum) a chain of
// fp32 FMAs over the slots in order, several rows at a time. Not P V on the tiles (or on
// vdpbf16ps): a tile sums its 32 k (here slots) in an order of its own, so where masked siblings
// move a slot within a tile (a tree's verify against the one-row steps) bf16 outputs parted (4 of
// 8 long prompts). A row's result does not depend on the rows beside it or on masked slots, as
// above; the bits differ from the loops' and between the two (one choice a process).
// Head size 256 (Gemma's) has no AMX instance: Q's 8 tiles of 32 d and K and the scores would take
// 10 of the 8 tiles; an "amx" process computes those calls on the loops.
enum Bf16Scores : int { kLoops = 0, kAmx = 1, kDot = 2 };
std::atomic<int> g_bf16_scores{kLoops};

bool dot_usable() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// mode: "loops", "amx" or "dot"; where the CPU lacks it, "loops". Returns the mode in effect.
std::string set_bf16_scores(const std::string& mode) {
  TORCH_CHECK(mode == "loops" || mode == "amx" || mode == "dot",
              "avx2_attention: bf16 scores must be loops, amx or dot, got ", mode);
  const int m = mode == "amx" && eagle::amx_usable() ? kAmx : mode == "dot" && dot_usable() ? kDot : kLoops;
  g_bf16_scores = m;
  return m == kAmx ? "amx" : m == kDot ? "dot" : "loops";
}

std::string bf16_scores() {
  const int m = g_bf16_scores.load();
  return m == kAmx ? "amx" : m == kDot ? "dot" : "loops";
}

#define EAGLE_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define EAGLE_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define EAGLE_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,amx-tile,amx-bf16")))

// Tiles 0 to D / 32 + 1, each 16 rows of 64 bytes: 0 K (A), 1 .. D / 32 Q's d 0-31, 32-63, .. (B),
// the last the scores.
template <int D>
EAGLE_AMX_TARGET inline void configure_tiles() {
  eagle::TileConfig cfg;
  for (int t = 0; t < D / 32 + 2; t++) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// in [16][16] (rows `in_stride` apart) -> out rows r (of `rows`) at out + r * stride: out[r][i] =
// in[i][r] (32-bit elements: floats, or bf16 pairs as they lie)
EAGLE_AVX512_TARGET inline void transpose_16x16(const float* in, int64_t in_stride, float* out, int64_t stride,
                                                int64_t rows) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(in + i * in_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
  for (int64_t i = 0; i < rows; i++) _mm512_storeu_ps(out + i * stride, r[i]);
}

// bf16 rounding of 16 floats (ties to even), as c10::BFloat16 rounds finite values
EAGLE_AVX512_TARGET inline __m256i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}

EAGLE_AVX512_TARGET inline __m512 from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Keys j..j+n (n <= 16) of a bf16 cache (rows `stride` apart) as a block of 16 rows: in place where
// it is full, else copied into buf with zero rows after them (not the cache's next slots). Returns
// the rows and their stride.
template <int D>
inline std::pair<const at::BFloat16*, int64_t> key_block16(const at::BFloat16* k, int64_t n, int64_t stride,
                                                            at::BFloat16* buf) {
  if (n == 16) return {k, stride};
  std::memset(static_cast<void*>(buf), 0, 16 * D * sizeof(at::BFloat16));
  for (int64_t i = 0; i < n; i++) std::memcpy(buf + i * D, k + i * stride, D * sizeof(at::BFloat16));
  return {buf, D};
}

// NR rows' sums o[r] [16 C of d] += p[r][i] v[i] and sums[r] [16 lanes alike] += p[r][i] over the n
// slots of a block (v: 16 rows of fp32 D apart, from the first of the C columns of 16 d; o: rows
// D apart, from the same column; p: rows `stride` apart), slot by slot: a chain a row and d,
// whatever NR and C.
template <int NR, int C, int D>
EAGLE_AVX512_TARGET inline void pv_rows(const float* p, int64_t stride, const float* v, int64_t n, float* o,
                                        float* sums) {
  __m512 acc[NR][C], sum[NR];
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < C; c++) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
    sum[r] = _mm512_loadu_ps(sums + 16 * r);
  }
  for (int64_t i = 0; i < n; i++) {
    __m512 vc[C];
    for (int c = 0; c < C; c++) vc[c] = _mm512_load_ps(v + i * D + 16 * c);
    for (int r = 0; r < NR; r++) {
      const __m512 pr = _mm512_set1_ps(p[r * stride + i]);
      for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(pr, vc[c], acc[r][c]);
      sum[r] = _mm512_add_ps(sum[r], pr);
    }
  }
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < C; c++) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
    _mm512_storeu_ps(sums + 16 * r, sum[r]);
  }
}

// R rows' scores (q . k, raw: rows S16 apart) -> p (the same or another buffer): each row's softmax
// weights, p = exp(s * scale + bias - max), exactly 0 where masked (normalised later, by P V's sum).
EAGLE_AVX512_TARGET void softmax_rows(const float* raw, float* p, int64_t S16, int64_t R, const at::BFloat16* bias,
                                      int64_t bias_stride, int64_t T, int64_t S, int64_t r0, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < R; r++) {
    const float* s = raw + r * S16;
    float* pr = p + r * S16;
    const at::BFloat16* b = bias + ((r0 + r) % T) * bias_stride;
    __m512 vm = neg_inf;
    for (int64_t j = 0; j < S16; j += 16) {
      const __mmask16 in = j + 16 <= S ? __mmask16(0xFFFF) : __mmask16((1u << (S - j)) - 1);
      const __m512 bj = from_bf16(_mm256_maskz_loadu_epi16(in, b + j));
      const __m512 x = _mm512_mask_blend_ps(in, neg_inf, _mm512_fmadd_ps(_mm512_loadu_ps(s + j), vscale, bj));
      _mm512_storeu_ps(pr + j, x);
      vm = _mm512_max_ps(vm, x);
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
    for (int64_t j = 0; j < S16; j += 16) {
      const __m512 x = _mm512_loadu_ps(pr + j);
      const __mmask16 live = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
      _mm512_storeu_ps(pr + j, _mm512_maskz_mov_ps(live, eagle::exp16(_mm512_sub_ps(x, m))));
    }
  }
}

// out[.., d0..d0 + 16 C) of rows r0.. = P V / sum for R rows' softmax weights p (rows S16 apart),
// each d and the weights' sum a chain of fp32 FMAs (adds) over the slots in order, as the loops
// above: a slot's place (the masked slots around it) does not change a row's sums, nor does how
// many columns of d a call computes. vahead: V's rows (of these columns) asked for kKeysAhead slots
// ahead, where nothing else has asked for them.
template <int C, int D>
EAGLE_AVX512_TARGET void pv_out(const float* p, int64_t S16, int64_t R, const at::BFloat16* v, int64_t kv_stride,
                                int64_t T, int64_t S, int64_t r0, int64_t d0, bool vahead, at::BFloat16* out,
                                int64_t out_h, int64_t out_t) {
  thread_local std::vector<float> o, sums;
  o.assign(R * D, 0.f);
  sums.assign(R * 16, 0.f);
  alignas(64) float vf[16][D];
  constexpr int64_t kLine = 64 / sizeof(at::BFloat16);  // d a cache line holds
  if (vahead)
    for (int64_t i = 0; i < std::min(S, kKeysAhead); i++)
      for (int64_t d = d0; d < d0 + 16 * C; d += kLine) _mm_prefetch(reinterpret_cast<const char*>(v + i * kv_stride + d), _MM_HINT_T1);
  for (int64_t j = 0; j < S; j += 16) {
    const int64_t n = std::min<int64_t>(16, S - j);
    if (vahead)
      for (int64_t i = j + kKeysAhead; i < std::min(S, j + kKeysAhead + n); i++)
        for (int64_t d = d0; d < d0 + 16 * C; d += kLine) _mm_prefetch(reinterpret_cast<const char*>(v + i * kv_stride + d), _MM_HINT_T1);
    for (int64_t i = 0; i < n; i++)
      for (int64_t d = d0; d < d0 + 16 * C; d += 16)
        _mm512_store_ps(vf[i] + d, from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (j + i) * kv_stride + d))));
    int64_t r = 0;
    const float* pr = p + j;
    float *orow = o.data() + d0, *srow = sums.data();
    for (; r + 4 <= R; r += 4) pv_rows<4, C, D>(pr + r * S16, S16, vf[0] + d0, n, orow + r * D, srow + r * 16);
    for (; r + 2 <= R; r += 2) pv_rows<2, C, D>(pr + r * S16, S16, vf[0] + d0, n, orow + r * D, srow + r * 16);
    for (; r < R; r++) pv_rows<1, C, D>(pr + r * S16, S16, vf[0] + d0, n, orow + r * D, srow + r * 16);
  }
  for (int64_t r = 0; r < R; r++) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[r * 16]);
    const int64_t g = (r0 + r) / T, t = (r0 + r) % T;
    at::BFloat16* dst = out + g * out_h + t * out_t;
    for (int64_t d = d0; d < d0 + 16 * C; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), to_bf16(_mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + d), inv)));
  }
}

// R rows' scores (sc: rows S16 apart) -> out: each row's softmax in place, then P V / sum for rows
// r0.. of the call (see above), 64 of d a pass.
template <int D>
EAGLE_AVX512_TARGET void softmax_pv(float* sc, int64_t S16, int64_t R, const at::BFloat16* v, int64_t kv_stride,
                                    const at::BFloat16* bias, int64_t bias_stride, int64_t T, int64_t S, int64_t r0,
                                    float scale, at::BFloat16* out, int64_t out_h, int64_t out_t, bool vahead = false) {
  softmax_rows(sc, sc, S16, R, bias, bias_stride, T, S, r0, scale);
  for (int64_t d0 = 0; d0 < D; d0 += 64) pv_out<4, D>(sc, S16, R, v, kv_stride, T, S, r0, d0, vahead, out, out_h, out_t);
}

// sc[r][0..16) = NR rows' scores against a packed block of 16 keys (kp[p]: their d pair p), each a
// chain of vdpbf16ps over the D / 2 pairs in order; q rows D apart.
template <int NR, int D>
EAGLE_DOT_TARGET inline void dot_rows(const at::BFloat16* q, const __m512i* kp, float* sc, int64_t ldc) {
  __m512 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
  const auto* qp = reinterpret_cast<const int32_t*>(q);
  for (int p = 0; p < D / 2; p++) {
    const __m512bh kpair = (__m512bh)_mm512_load_si512(kp + p);
    for (int r = 0; r < NR; r++)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(qp[r * D / 2 + p]), kpair);
  }
  for (int r = 0; r < NR; r++) _mm512_storeu_ps(sc + r * ldc, acc[r]);
}

// NR = rows (1-8) of dot_rows<NR, D>.
template <int D, int NR = 8>
EAGLE_DOT_TARGET inline void dot_rows_of(int64_t rows, const at::BFloat16* q, const __m512i* kp, float* sc,
                                         int64_t ldc) {
  if constexpr (NR > 0) {
    if (rows != NR) return dot_rows_of<D, NR - 1>(rows, q, kp, sc, ldc);
    dot_rows<NR, D>(q, kp, sc, ldc);
  }
}

// sc[r][j0..j1) = q's R rows (D apart) . keys j0..j1 (j0 a multiple of 16, j1 of 16 or S) of S, on
// vdpbf16ps; v: V's rows, asked for as the keys go (or null).
template <int D>
EAGLE_DOT_TARGET void scores_dot(const at::BFloat16* q, int64_t R, const at::BFloat16* k, const at::BFloat16* v,
                                 int64_t kv_stride, int64_t S, int64_t j0, int64_t j1, float* sc, int64_t S16) {
  alignas(64) __m512i kp[D / 2];
  alignas(64) at::BFloat16 kbuf[16 * D];
  for (int64_t j = j0; j < j1; j += 16) {
    const int64_t n = std::min<int64_t>(16, S - j);
    prefetch_ahead<D>(k, v, j, n, j1, kv_stride, j0);
    const auto [kb, kst] = key_block16<D>(k + j * kv_stride, n, kv_stride, kbuf);
    // the 16 keys' D / 2 d pairs as 32-bit elements, transposed: kp[p] lane i = key i's pair p
    for (int h = 0; h < D / 32; h++)
      transpose_16x16(reinterpret_cast<const float*>(kb + 32 * h), kst / 2, reinterpret_cast<float*>(kp + 16 * h),
                      16, 16);
    for (int64_t r = 0; r < R; r += 8)
      dot_rows_of<D>(std::min<int64_t>(8, R - r), q + r * D, kp, sc + r * S16 + j, S16);
  }
}

// attend_rows for rows r0..r1 of a bf16 call, scores on vdpbf16ps (see above). V is asked for
// as P V reads it, not as the scores go: a step meets K and V in memory, and asked for together
// they arrived faster than the scores used them and then P V, from L2, ran on a bus left idle;
// split so, each phase streams one of them (batch 32 at 1,024 slots: the fused layers 72 -> 63 ms
// a step, 2-core Zen 4; batch 1's calls split otherwise, split_phase, and are unchanged).
template <int D>
EAGLE_DOT_TARGET void attend_rows_dot(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                                      int64_t kv_stride, const at::BFloat16* bias, int64_t bias_stride, int64_t T,
                                      int64_t S, int64_t r0, int64_t r1, float scale, at::BFloat16* out,
                                      int64_t out_h, int64_t out_t) {
  const int64_t R = r1 - r0, S16 = (S + 15) / 16 * 16;
  thread_local std::vector<float> sc;
  sc.resize(R * S16);
  scores_dot<D>(q + r0 * D, R, k, nullptr, kv_stride, S, 0, S, sc.data(), S16);
  softmax_pv<D>(sc.data(), S16, R, v, kv_stride, bias, bias_stride, T, S, r0, scale, out, out_h, out_t, true);
}

// attend_rows for up to 16 rows r0..r1 of a bf16 call, scores on the tiles (see above).
template <int D>
EAGLE_AMX_TARGET void attend_rows_amx(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                                      int64_t kv_stride, const at::BFloat16* bias, int64_t bias_stride, int64_t T,
                                      int64_t S, int64_t r0, int64_t r1, float scale, at::BFloat16* out,
                                      int64_t out_h, int64_t out_t) {
  const int64_t R = r1 - r0, S16 = (S + 15) / 16 * 16;
  thread_local std::vector<float> sc;
  sc.resize(16 * S16);
  configure_tiles<D>();
  // Q's rows as B tiles: qt[c][p][r] = the pair (d 32c + 2p, 32c + 2p + 1) of row r; rows past R 0
  alignas(64) uint32_t qt[D / 32][16][16] = {};
  for (int64_t r = 0; r < R; r++) {
    const auto* qr = reinterpret_cast<const uint32_t*>(q + (r0 + r) * D);
    for (int c = 0; c < D / 32; c++)
      for (int p = 0; p < 16; p++) qt[c][p][r] = qr[16 * c + p];
  }
  // (the tile intrinsics take their tile numbers as literals)
  _tile_loadd(1, qt[0], 64);
  _tile_loadd(2, qt[1], 64);
  if constexpr (D == 128) {
    _tile_loadd(3, qt[2], 64);
    _tile_loadd(4, qt[3], 64);
  }
  alignas(64) float ct[16][16];
  alignas(64) at::BFloat16 kbuf[16 * D];
  for (int64_t j = 0; j < S; j += 16) {
    const int64_t n = std::min<int64_t>(16, S - j);
    const auto [kb, kst] = key_block16<D>(k + j * kv_stride, n, kv_stride, kbuf);
    const int64_t stride = kst * sizeof(at::BFloat16);
    if constexpr (D == 64) {
      _tile_zero(3);
      _tile_loadd(0, kb, stride);
      _tile_dpbf16ps(3, 0, 1);
      _tile_loadd(0, kb + 32, stride);
      _tile_dpbf16ps(3, 0, 2);
      _tile_stored(3, ct[0], 64);
    } else {
      _tile_zero(5);
      _tile_loadd(0, kb, stride);
      _tile_dpbf16ps(5, 0, 1);
      _tile_loadd(0, kb + 32, stride);
      _tile_dpbf16ps(5, 0, 2);
      _tile_loadd(0, kb + 64, stride);
      _tile_dpbf16ps(5, 0, 3);
      _tile_loadd(0, kb + 96, stride);
      _tile_dpbf16ps(5, 0, 4);
      _tile_stored(5, ct[0], 64);
    }
    transpose_16x16(ct[0], 16, sc.data() + j, S16, R);
  }
  softmax_pv<D>(sc.data(), S16, R, v, kv_stride, bias, bias_stride, T, S, r0, scale, out, out_h, out_t);
}

// Whether a call's bf16 scores run on vdpbf16ps: its mode, and K's rows readable as 32-bit pairs (a
// cache's rows and heads are 64 values apart).
bool on_dot(const eagle::AttentionCall& c) {
  return c.bf16 && g_bf16_scores.load(std::memory_order_relaxed) == kDot && c.row % 2 == 0 && c.batch % 2 == 0 &&
         c.head % 2 == 0 && reinterpret_cast<uintptr_t>(c.k) % 4 == 0;
}

// Where a call's (batch, kv head) pair bk reads and writes: its query group's q rows and bias rows,
// its output, and its K and V rows' offset in the cache (tasks() and split_phase alike).
template <typename KV>
struct Pair {
  const KV *q, *bias;
  KV* out;
  int64_t kv0;
};
template <typename KV>
Pair<KV> pair_of(const eagle::AttentionCall& c, int64_t bk) {
  const int64_t b = bk / c.KVH, kvh = bk % c.KVH, h0 = kvh * (c.H / c.KVH);  // the group's first query head
  return {static_cast<const KV*>(c.q) + (b * c.H + h0) * c.T * c.D, static_cast<const KV*>(c.bias) + b * c.T * c.S,
          static_cast<KV*>(c.out) + b * c.out_b + h0 * c.out_h, b * c.batch + kvh * c.head};
}

// Tasks t0..t1 of an AttentionCall, each (batch, kv head, chunk of its G * T rows): what each
// thread of a parallel region computes (eagle::AttentionTasks).
template <typename KV, int D>
void tasks(const eagle::AttentionCall& c, int64_t t0, int64_t t1, float* scores) {
  const int64_t G = c.H / c.KVH, R = G * c.T, per_chunk = (R + c.chunks - 1) / c.chunks;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const KV *kp = static_cast<const KV*>(c.k), *vp = static_cast<const KV*>(c.v);
  [[maybe_unused]] const bool dot = on_dot(c);
  for (int64_t task = t0; task < t1; task++) {
    const int64_t ch = task % c.chunks;
    const int64_t r0 = ch * per_chunk, r1 = std::min(R, r0 + per_chunk);
    if (r0 >= r1) continue;
    const auto [qb, bb, ob, kv0] = pair_of<KV>(c, task / c.chunks);
    const int64_t live = live_slots(bb, c.S, c.T, c.S);
    if constexpr (std::is_same_v<KV, at::BFloat16>) {
      if (dot) {
        attend_rows_dot<D>(qb, kp + kv0, vp + kv0, c.row, bb, c.S, c.T, live, r0, r1, scale, ob, c.out_h, c.out_t);
        continue;
      }
      if constexpr (D <= 128) {
        if (g_bf16_scores.load(std::memory_order_relaxed) == kAmx) {
          for (int64_t s0 = r0; s0 < r1; s0 += 16)
            attend_rows_amx<D>(qb, kp + kv0, vp + kv0, c.row, bb, c.S, c.T, live, s0, std::min(r1, s0 + 16), scale, ob,
                               c.out_h, c.out_t);
          continue;
        }
      }
    }
    attend_rows<D>(qb, kp + kv0, vp + kv0, c.row, bb, c.S, c.T, live, r0, r1, scale, scores, ob, c.out_h, c.out_t);
  }
}

// f(std::integral_constant<int, D>{}) for head size D: 64, 128 or 256 (the ops check it first)
template <typename F>
void with_head_size(int64_t D, F&& f) {
  if (D == 64)
    f(std::integral_constant<int, 64>{});
  else if (D == 128)
    f(std::integral_constant<int, 128>{});
  else
    f(std::integral_constant<int, 256>{});
}

void attention_tasks(const eagle::AttentionCall& c, int64_t t0, int64_t t1, float* scores) {
  with_head_size(c.D, [&](auto d) {
    constexpr int D = decltype(d)::value;
    c.bf16 ? tasks<at::BFloat16, D>(c, t0, t1, scores) : tasks<float, D>(c, t0, t1, scores);
  });
}

// A call's attention in two phases, each in halves across the threads, where its (batch, kv head)
// pairs alone would leave a thread idle (a decode step at batch 1: 3 kv heads on 2 threads, one
// thread doing two while the other does one; kernel_calls.h split_attention). Phase 1, task (pair,
// half): its rows' scores against that half of the keys into `shared` (on vdpbf16ps); phase 2, task
// (pair, half): its rows' softmax from the shared scores (both halves compute it, alike), then P V
// for that half of d. Every value is computed as attend_rows_dot computes it (a score a slot, a
// softmax a row, a chain a row and d), so the outputs are its, bit for bit; only the work moves,
// each K and V byte read by one task. A step meets K and V cold, and a thread with two kv heads
// read twice the bytes of one with one. The fused layers run it (a barrier between the phases in
// their parallel region): a decode step of the default target 1.065x faster at 1,200 slots, level
// at 100 (2-core Zen 4). Not this file's op: as two parallel regions a call over 100-600 slots ran
// 0.64-0.90x the unsplit call's speed, level at 1,200.
//   split_tasks: the tasks of each phase, 0 where the call does not split this way (bf16 scores not
// on vdpbf16ps, or rows in chunks): then attention_tasks. Not on the AVX2 loops: split the same
// way, a step over 1,200 slots ran 0.97x (bf16) and 0.92x (fp32) of the unsplit one (2-core Zen 4),
// and still 0.91x / 0.94x with their P V running 3 rows side by side; why is not known yet.
int64_t split_tasks(const eagle::AttentionCall& c) {
  return c.chunks == 1 && c.D <= 128 && on_dot(c) ? c.B * c.KVH * 2 : 0;
}

// Tasks t0..t1 of phase 1 or 2 (above); shared: B * KVH * G * T * S16 floats (S16: S rounded up to 16).
template <int D>
void split_phase_of(const eagle::AttentionCall& c, int64_t phase, int64_t t0, int64_t t1, float* shared) {
  const int64_t R = c.H / c.KVH * c.T, area = R * ((c.S + 15) / 16 * 16);  // a pair's share of `shared`
  const auto *kp = static_cast<const at::BFloat16*>(c.k), *vp = static_cast<const at::BFloat16*>(c.v);
  for (int64_t task = t0; task < t1; task++) {
    const int64_t half = task % 2, bk = task / 2;
    const auto [q, bias, out, kv0] = pair_of<at::BFloat16>(c, bk);
    // both phases' tasks of a pair find the same slots, so its halves and its scores' rows agree
    const int64_t S = live_slots(bias, c.S, c.T, c.S), S16 = (S + 15) / 16 * 16, half_keys = (S16 / 16 + 1) / 2 * 16;
    float* sc = shared + bk * area;
    if (phase == 1) {
      const int64_t j0 = half * half_keys, j1 = std::min(S, j0 + half_keys);
      if (j0 < j1) scores_dot<D>(q, R, kp + kv0, nullptr, c.row, S, j0, j1, sc, S16);
    } else {
      thread_local std::vector<float> p;
      p.resize(R * S16);
      softmax_rows(sc, p.data(), S16, R, bias, c.S, c.T, S, 0, 1.f / std::sqrt(static_cast<float>(D)));
      pv_out<D / 32, D>(p.data(), S16, R, vp + kv0, c.row, c.T, S, 0, D / 2 * half, true, out, c.out_h, c.out_t);
    }
  }
}

void split_phase(const eagle::AttentionCall& c, int64_t phase, int64_t t0, int64_t t1, float* shared) {
  c.D == 128 ? split_phase_of<128>(c, phase, t0, t1, shared) : split_phase_of<64>(c, phase, t0, t1, shared);
}

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& bias_in) {
  const int64_t B = q_in.size(0), H = q_in.size(1), T = q_in.size(2), KVH = keys.size(1), S = keys.size(2);
  const int64_t D = q_in.size(3);
  const at::Tensor q = q_in.contiguous(), bias = bias_in.contiguous();  // no copies for the model's
  at::Tensor out = at::empty({B, H, T, D}, q.options());
  const int64_t R = (H / KVH) * T, chunks = eagle::attention_chunks(R, B, KVH, at::get_num_threads());
  const eagle::AttentionCall call{q.scalar_type() == at::kBFloat16, q.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                  bias.data_ptr(), out.data_ptr(), B, H, T, KVH, S, keys.stride(0), keys.stride(1),
                                  keys.stride(2), H * T * D, T * D, D, chunks, D};
  at::parallel_for(0, B * KVH * chunks, 1, [&](int64_t begin, int64_t end) {
    // the loops' scratch (dot and AMX keep their own): kept by the thread from call to call
    thread_local std::vector<float> scores;
    scores.resize((R + chunks - 1) / chunks * S);
    attention_tasks(call, begin, end, scores.data());
  });
  return out;
}

at::Tensor avx2_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& bias_in) {
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && keys.scalar_type() == dtype &&
                  values.scalar_type() == dtype && bias_in.scalar_type() == dtype,
              "avx2_attention: fp32 or bf16 only, q, keys, values and bias of one dtype");
  TORCH_CHECK(q_in.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && bias_in.dim() == 4,
              "avx2_attention: q [B, H, T, D], keys / values [B, KVH, S, D], bias [B, 1, T, S]");
  const int64_t B = q_in.size(0), H = q_in.size(1), T = q_in.size(2), D = q_in.size(3);
  const int64_t KVH = keys.size(1), S = keys.size(2);
  TORCH_CHECK((D == 64 || D == 128 || D == 256) && keys.size(3) == D && values.sizes() == keys.sizes() &&
                  keys.size(0) == B && KVH > 0 && H % KVH == 0 && S > 0,
              "avx2_attention: head size 64, 128 or 256 and heads a multiple of kv heads, got q ", q_in.sizes(),
              " keys ", keys.sizes(), " values ", values.sizes());
  TORCH_CHECK(bias_in.size(0) == B && bias_in.size(1) == 1 && bias_in.size(2) == T && bias_in.size(3) == S,
              "avx2_attention: bias ", bias_in.sizes(), " is not [B, 1, T, S] for q ", q_in.sizes(),
              " and ", S, " keys");
  // K and V in place: a cache view's rows are contiguous, its heads and sequences strided
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.stride(2) == values.stride(2) &&
                  keys.stride(1) == values.stride(1) && keys.stride(0) == values.stride(0),
              "avx2_attention: keys and values must share strides with contiguous rows");
  // q, bias and K and V read in place, in their own dtype (widened as read); out in that dtype
  return attend(q_in, keys, values, bias_in);
}

// ---------------------------------------------------------------------------------------------
// A prefill's attention from slot 0: out[b, h, t] = softmax_{j <= t}(q[b, h, t] . K[b, h / G, j] /
// sqrt(D)) V[b, h / G], over the T slots the prefill wrote (model.attention's `causal` branch). fp32
// or bf16 in and out, fp32 arithmetic, AVX2 + FMA.
//
// Why not SDPA's causal flash kernel: at a 1,089-token prompt (9 heads over 3, D 64, bf16, 2
// threads) it runs ~40 GMAC/s on a 2-core AMD EPYC Zen 4 (17 ms a layer, 38% of the prefill) and
// ~34 on a Zen 2. Here a task is 16 query positions of one (batch, kv head): their G * 16 rows'
// scores against every key up to the block's end (K transposed in blocks of 8 keys, so 6 rows x 16
// keys of sums stay in registers over d and no horizontal sums are needed), each row's softmax
// over its own keys, then P V (6 rows x 16 of d in registers over the keys). K and V are widened
// to fp32 once (K transposed) for all the tasks that read them. No bit-identity with the decode
// loops above is needed: a prefill's rows are computed the same way in plain and speculative
// decoding, and nothing else compares them bit for bit. Measured there (bf16, 9 heads over 3,
// 1,089 positions, 2 threads): 9.8 ms a layer against SDPA's 15-16 ms, and FMA-bound (perf).
constexpr int64_t kQBlock = 16;  // query positions a task
constexpr int64_t kKeyBlock = 8;  // keys a transposed block: one 8-float register a d
constexpr int64_t kTileRows = 6;  // rows of a score or P V tile: 6 x 2 sums, 2 operands, 1 broadcast

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Keys kb*8 .. kb*8+7 of one (batch, kv head), K [S][D] rows `row` apart, as kt [D][8] fp32 (keys
// past S zero), and the same values' rows as vf [8][D] fp32.
template <int D, typename KV>
inline void widen_block(const KV* k, const KV* v, int64_t row, int64_t S, int64_t kb, float* kt, float* vf) {
  for (int64_t i = 0; i < kKeyBlock; i++) {
    const int64_t j = kb * kKeyBlock + i;
    alignas(32) float kr[D] = {};
    if (j < S) {
      row_as_fp32<D>(k + j * row, kr);
      row_as_fp32<D>(v + j * row, vf + i * D);
    } else {
      std::fill(vf + i * D, vf + (i + 1) * D, 0.f);
    }
    for (int64_t d = 0; d < D; d++) kt[d * kKeyBlock + i] = kr[d];
  }
}

// c[r][0..16) = sum_{k < n} a[r][k] (b0[k], b1[k]) for NR rows (a rows `lda` apart; b0, b1 8 floats
// each, `ldb` apart a k; c rows `ldc` apart): the 2 NR sums stay in registers while k runs (6 x 2
// + 2 operands + 1 broadcast of 16 registers). The scores (a: q rows, k: d, b: two transposed key
// blocks) and P V (a: p rows, k: keys, b: 16 of d of V's rows) are both this tile. The loops over
// the rows are unrolled, the stores included: else GCC keeps the sums in memory.
template <int NR>
inline void tile(const float* a, int64_t lda, const float* b0, const float* b1, int64_t ldb, int64_t n,
                 float* c, int64_t ldc) {
  __m256 acc[NR][2];
#pragma GCC unroll 6
  for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k++) {
    const __m256 v0 = _mm256_loadu_ps(b0 + k * ldb), v1 = _mm256_loadu_ps(b1 + k * ldb);
#pragma GCC unroll 6
    for (int r = 0; r < NR; r++) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(x, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, v1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < NR; r++) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

// NR = rows (1-6) of tile<NR>.
template <int NR = kTileRows>
inline void tile_of(int64_t rows, const float* a, int64_t lda, const float* b0, const float* b1, int64_t ldb,
                    int64_t n, float* c, int64_t ldc) {
  if constexpr (NR > 0) {
    if (rows != NR) return tile_of<NR - 1>(rows, a, lda, b0, b1, ldb, n, c, ldc);
    tile<NR>(a, lda, b0, b1, ldb, n, c, ldc);
  }
}

// One task: query positions t0..t1 (t0 a multiple of 16) of one (batch, kv head), rows r = (t - t0)
// * G + g (position major: a tile's last row has its most keys). kt, vf: that kv head's keys and
// values widened (widen_block) up to a multiple of 16 keys. window > 0: position t sees keys
// t - window + 1 .. t only (a sliding layer's), and the task skips the 16-key tiles before its
// first row's first key.
template <int D, typename KV>
void causal_task(const KV* q, int64_t q_h, int64_t q_t, const float* kt, const float* vf, int64_t G, int64_t t0,
                 int64_t t1, int64_t offset, int64_t window, KV* out, int64_t out_h, int64_t out_t,
                 std::vector<float>& buf) {
  // scores of keys 0..ld-1 a row (from j0 on); p0: the task's first position
  const int64_t R = (t1 - t0) * G, p0 = offset + t0, ld = round_up(p0 + kQBlock, 2 * kKeyBlock);
  const int64_t j0 = window ? std::max<int64_t>(0, p0 - window + 1) / (2 * kKeyBlock) * (2 * kKeyBlock) : 0;
  buf.resize(R * (2 * D + ld + 1));
  float *qs = buf.data(), *o = qs + R * D, *sums = o + R * D, *sc = sums + R;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  for (int64_t r = 0; r < R; r++) {
    const KV* qr = q + (r % G) * q_h + (t0 + r / G) * q_t;
    for (int64_t d = 0; d < D; d++) qs[r * D + d] = static_cast<float>(qr[d]) * scale;
  }
  for (int64_t r = 0; r < R; r += kTileRows)  // scores: 16 keys (two transposed blocks) a tile
    for (int64_t j = j0; j < ld; j += 2 * kKeyBlock)
      tile_of(std::min(kTileRows, R - r), qs + r * D, D, kt + j * D, kt + (j + kKeyBlock) * D, kKeyBlock, D,
              sc + r * ld + j, ld);
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY), iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float lanes[8];
  for (int64_t r = 0; r < R; r++) {  // p = exp(s - max) over the row's keys lo..t, 0 around them
    float* s = sc + r * ld;
    const int64_t n = p0 + r / G + 1, lo = window ? std::max<int64_t>(0, n - window) : 0;
    // a block's lanes before lo or past n masked
    auto live = [&](int64_t j) {
      const __m256 l = _mm256_sub_ps(iota, _mm256_set1_ps(static_cast<float>(lo - j)));
      return _mm256_and_ps(_mm256_cmp_ps(l, _mm256_setzero_ps(), _CMP_GE_OQ),
                           _mm256_cmp_ps(iota, _mm256_set1_ps(static_cast<float>(n - j)), _CMP_LT_OQ));
    };
    __m256 vmax = neg_inf;
    for (int64_t j = j0; j < n; j += 8) {
      const __m256 x = _mm256_loadu_ps(s + j);
      vmax = _mm256_max_ps(vmax, j + 8 > n || j < lo ? _mm256_blendv_ps(neg_inf, x, live(j)) : x);
    }
    _mm256_store_ps(lanes, vmax);
    const __m256 vm = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = j0; j < n; j += 8) {
      __m256 e = eagle::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
      if (j + 8 > n || j < lo) e = _mm256_and_ps(e, live(j));
      _mm256_storeu_ps(s + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_store_ps(lanes, vsum);
    sums[r] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    std::fill(s + (n + 7) / 8 * 8, s + ld, 0.f);
  }
  for (int64_t r = 0; r < R; r += kTileRows) {
    const int64_t rows = std::min(kTileRows, R - r), n = p0 + (r + rows - 1) / G + 1;
    for (int64_t d0 = 0; d0 < D; d0 += 16)  // P V: 16 of d a tile, over keys j0..n
      tile_of(rows, sc + r * ld + j0, ld, vf + j0 * D + d0, vf + j0 * D + d0 + 8, D, n - j0, o + r * D + d0, D);
  }
  for (int64_t r = 0; r < R; r++) {
    const __m256 inv = _mm256_set1_ps(1.f / sums[r]);
    KV* dst = out + (r % G) * out_h + (t0 + r / G) * out_t;
    for (int d = 0; d < D; d += 8) eagle::store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d), inv));
  }
}

template <typename KV, int D>
void causal(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t offset, int64_t window,
            at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), KVH = keys.size(1), G = H / KVH;
  // keys widened: up to the last task's ld (causal_task), those past offset + T zero
  const int64_t qblocks = (T + kQBlock - 1) / kQBlock, S = offset + T;
  const int64_t blocks = round_up(offset + qblocks * kQBlock, 2 * kKeyBlock) / kKeyBlock;
  const int64_t per_head = blocks * kKeyBlock * D;
  // every (batch, kv head)'s K (transposed in blocks of 8 keys) and V as fp32, then the tasks
  std::vector<float> kt(B * KVH * per_head), vf(B * KVH * per_head);
  const KV *kp = keys.data_ptr<KV>(), *vp = values.data_ptr<KV>(), *qp = q.data_ptr<KV>();
  KV* op = out.data_ptr<KV>();
  at::parallel_for(0, B * KVH * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const int64_t bk = i / blocks, kb = i % blocks, off = bk / KVH * keys.stride(0) + bk % KVH * keys.stride(1);
      const int64_t at = bk * per_head + kb * kKeyBlock * D;
      widen_block<D>(kp + off, vp + off, keys.stride(2), S, kb, kt.data() + at, vf.data() + at);
    }
  });
  // tasks from the last query block down (the costliest first), each taken by the next free thread
  const int64_t tasks = qblocks * B * KVH;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t i = next++; i < tasks; i = next++) {
      const int64_t qb = qblocks - 1 - i / (B * KVH), bk = i % (B * KVH), b = bk / KVH, h = bk % KVH;
      const int64_t t0 = qb * kQBlock, t1 = std::min(T, t0 + kQBlock);
      causal_task<D>(qp + b * q.stride(0) + h * G * q.stride(1), q.stride(1), q.stride(2),
                     kt.data() + bk * per_head, vf.data() + bk * per_head, G, t0, t1, offset, window,
                     op + b * out.stride(0) + h * G * out.stride(1), out.stride(1), out.stride(2), buf);
    }
  });
}

// q [B, H, T, D] (any strides, rows contiguous), keys / values [B, KVH, S >= offset + T, D] cache
// views (slots 0..offset+T-1 used: query t at position offset + t, a chunk's or a prefix hit's
// prefill past the offset slots a row holds) -> out [B, H, T, D], a view of a contiguous [B, T, H, D]
// (what o_proj reads); D 64, 128 or 256. window > 0: each position sees its `window` latest (a
// sliding layer's prefill).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t window,
                            int64_t offset) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && keys.scalar_type() == dtype &&
                  values.scalar_type() == dtype,
              "causal_attention: fp32 or bf16 only, q, keys and values of one dtype");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4,
              "causal_attention: q [B, H, T, D], keys / values [B, KVH, S, D]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), KVH = keys.size(1), D = q.size(3);
  TORCH_CHECK((D == 64 || D == 128 || D == 256) && keys.size(3) == D && values.sizes() == keys.sizes() &&
                  keys.size(0) == B && KVH > 0 && H % KVH == 0 && offset >= 0 && keys.size(2) >= offset + T &&
                  T > 0,
              "causal_attention: head size 64, 128 or 256, heads a multiple of kv heads and at least offset + T keys, "
              "got q ", q.sizes(), " keys ", keys.sizes(), " values ", values.sizes(), " offset ", offset);
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.strides() == keys.strides(),
              "causal_attention: rows must be contiguous and keys and values share strides");
  TORCH_CHECK(window >= 0, "causal_attention: window must be >= 0 (0: none), got ", window);
  at::Tensor out = at::empty({B, T, H, D}, q.options()).transpose(1, 2);
  with_head_size(D, [&](auto d) {
    constexpr int HD = decltype(d)::value;
    dtype == at::kBFloat16 ? causal<at::BFloat16, HD>(q, keys, values, offset, window, out)
                           : causal<float, HD>(q, keys, values, offset, window, out);
  });
  return out;
}

// The cache write of a compiled step, eagle_infer::kv_write (defined in model.py): kv viewed as
// [-1, D], rows index[i] = new[i]. model.py's Python implementation costs ~6 us a call (the
// interpreter and an index_copy_ of a few 64-value rows; 2-core Xeon), 30 calls a step; this row
// copy loop ~1 us. Registered for CPU tensors, it takes precedence over that one wherever this library is
// loaded (with the attention kernel); other devices keep it.
void kv_write(const at::Tensor& kv, const at::Tensor& index, const at::Tensor& new_rows) {
  TORCH_CHECK(kv.device().is_cpu() && index.device().is_cpu() && new_rows.device().is_cpu(),
              "kv_write: CPU tensors only");
  TORCH_CHECK(kv.is_contiguous() && kv.scalar_type() == new_rows.scalar_type() && new_rows.dim() == 2 &&
                  index.scalar_type() == at::kLong && index.dim() == 1 && index.numel() == new_rows.size(0),
              "kv_write: a contiguous cache, new [n, D] of its dtype and int64 index [n], got cache ",
              kv.scalar_type(), " new ", new_rows.sizes(), " ", new_rows.scalar_type(), " index ",
              index.sizes(), " ", index.scalar_type());
  const int64_t D = new_rows.size(1), n = index.numel();
  TORCH_CHECK(D > 0 && kv.numel() % D == 0, "kv_write: cache of ", kv.numel(), " values is not rows of ", D);
  const int64_t rows = kv.numel() / D;
  const at::Tensor src = new_rows.contiguous(), idx = index.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const size_t bytes = D * src.element_size();
  char* dst = static_cast<char*>(kv.data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "kv_write: index ", ip[i], " outside the cache's ", rows, " rows");
    std::memcpy(dst + ip[i] * bytes, sp + i * bytes, bytes);
  }
}


// The addresses of attention_tasks (eagle::AttentionTasks), split_tasks and split_phase
// (eagle::AttentionSplitTasks, eagle::AttentionSplitPhase), for decoder_layers.cpp.
int64_t avx2_attention_tasks() {
  return reinterpret_cast<int64_t>(static_cast<eagle::AttentionTasks>(&attention_tasks));
}
int64_t avx2_attention_split_tasks() {
  return reinterpret_cast<int64_t>(static_cast<eagle::AttentionSplitTasks>(&split_tasks));
}
int64_t avx2_attention_split_phase() {
  return reinterpret_cast<int64_t>(static_cast<eagle::AttentionSplitPhase>(&split_phase));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("avx2_attention(Tensor q, Tensor keys, Tensor values, Tensor bias) -> Tensor");
  m.def("avx2_attention_tasks() -> int", &avx2_attention_tasks);
  m.def("avx2_attention_split_tasks() -> int", &avx2_attention_split_tasks);
  m.def("avx2_attention_split_phase() -> int", &avx2_attention_split_phase);
  m.def("avx2_attention_set_bf16_scores(str mode) -> str", &set_bf16_scores);
  m.def("avx2_attention_bf16_scores() -> str", &bf16_scores);
  m.def("causal_attention(Tensor q, Tensor keys, Tensor values, int window=0, int offset=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("avx2_attention", &avx2_attention);
  m.impl("causal_attention", &causal_attention);
}

TORCH_LIBRARY_IMPL(eagle_infer, CPU, m) {
  m.impl("kv_write", &kv_write);
}
