// The decoder layers of a Llama-family target (head size 64, 128 or 256; Qwen2's q/k/v biases and
// Qwen3's query/key norms too) or of a Gemma / Gemma 3 target (norms scaling by 1 + weight before
// rounding, norms on the attention's and the MLP's outputs, tanh GELU, a score scale of its own, and
// sliding layers with a mask and RoPE of their own) as one call per step on a CPU: what
// model.DecoderLayer computes,
// layer after layer, for a decode step's row or a verify's tree of rows, with the Linears and the
// attention on our kernels (bf16_linear.cpp, avx2_linear.cpp, avx2_attention.cpp) and the norms,
// RoPE, cache writes, the MLP's gate and residual adds as AVX2 loops in between, each rounded to the
// model's dtype where model.py's eager ops round.
//
// Why: a compiled step of the 30-layer default target runs ~150 kernel calls and ~100 small
// Inductor kernels, and Dynamo checks ~300 weight tensors' guards before each: on a 2-core Zen 4 with
// int8 weights ~2.4 ms of a 8.0 ms step ran on the main thread outside any kernel while the other
// thread waited (perf). The weights are registered once (register_stack) and a step names them
// by a handle, so a compiled step neither passes nor guards them.
//
// The whole step is one OpenMP parallel region: each thread computes its share of every Linear's
// panels and of the attention's tasks through the kernels' range functions (kernel_calls.h) and its
// share of the rows of the loops between, with a barrier after each phase. Calling each kernel's op
// instead (a parallel region, an output tensor and a dispatcher call each, ~150 a step) left the
// other thread waiting ~20% of the op's time (perf, Zen 4, int8). Measured against that, in one
// process, the same outputs bit for bit (2-core Zen 4, default target, kv 200, medians of 7 x 100
// calls): int8 1 row 4.07 -> 3.76 ms, 4 rows 5.81 -> 5.19; bf16 1 row 6.60 -> 6.06, 4 rows 7.70 -> 7.06.
//
// A row's result never depends on the rows beside it (each kernel's rows are independent and the
// loops here are per row), so a verify's rows equal one-row steps'.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "avx2_math.h"
#include "kernel_calls.h"

namespace {

enum Kind : int64_t { kAvx2 = 0, kBf16 = 1, kInt8 = 2 };  // the Linear kernel of a weight

// The tensors are kept (the stack owns them while registered); a step reads the raw pointers taken
// at registration, not each tensor's data_ptr (~1,000 checked calls a step).
struct Linear {
  int64_t kind;
  at::Tensor weight, scale;  // packed weight; int8: its panel scales
  int64_t out, in;           // N, K
  eagle::LinearPanels panels;  // the kernel's range function
  int64_t width;               // its panels' columns
  const void* w;               // weight's data
  const float* s;              // int8: scale's data, else nullptr
};

// A layer's norms are in the model's dtype (Llama's: w * dtype(normed x)), or with Gemma's offset in
// fp32 as 1 + w (Gemma's: dtype(normed x * (1 + w)), fp32 throughout: Stack.offset_norms).
struct Layer {
  at::Tensor in_norm, post_norm;  // [H]; post_norm: before the MLP, or with sandwich norms after the attention
  at::Tensor q_norm, k_norm;      // [D] (Qwen3, Gemma 3), else empty
  at::Tensor qkv_bias;            // [(heads + 2 kv_heads) D] (Qwen2), else empty
  at::Tensor pre_ffn_norm, post_ffn_norm;  // [H] (sandwich norms: Gemma 3), else empty
  Linear qkv, o, gate_up, down;
  const void *in_norm_data, *post_norm_data, *q_norm_data, *k_norm_data, *qkv_bias_data;  // nullptr where empty
  const void *pre_ffn_norm_data, *post_ffn_norm_data;
  bool local;  // a sliding layer: the step's local mask and RoPE (Gemma's)
};

struct Stack {
  std::vector<Layer> layers;
  int64_t heads, kv_heads, head_dim, intermediate;
  bool dot;
  bool qk_norm, qkv_bias, sandwich;  // every layer has them, or none
  bool offset_norms, gelu;  // Gemma's norms (1 + w, fp32) and tanh GELU gate, else Llama's and SiLU
  at::ScalarType dtype;     // the model's (its activations, cache and norms but offset ones)
  double eps;
  double query_factor;  // the rotated queries times this, rounded (1: none; Gemma's score scale)
  eagle::AttentionTasks attention;
  eagle::AttentionSplitTasks split_tasks;
  eagle::AttentionSplitPhase split_phase;
};

// The address a kernel library's op `name` returns (kernel_calls.h): the library is loaded (the
// model's Linears and attention run it) before a stack is registered.
template <typename... Args>
int64_t kernel_address(const char* name, Args... args) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<int64_t(Args...)>().call(args...);
}

std::mutex registry_mutex;
std::unordered_map<int64_t, Stack> registry;
int64_t next_id = 1;

// tensors: per layer in_norm, post_norm, q_norm, k_norm, qkv bias, pre_ffn_norm, post_ffn_norm (empty
// tensors where the target has none), then (packed weight, scale) for qkv, o, gate_up, down (scale:
// an empty tensor but for int8); kinds: per layer the four Linears' Kind; dims: heads, kv heads, head
// size, intermediate size, dot (bf16_linear's vdpbf16ps flag), offset_norms, gelu, bf16 (the model's
// dtype: else fp32); local_layers: the sliding layers that read the step's local mask and RoPE.
constexpr size_t kPerLayer = 15;
int64_t register_stack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& kinds,
                       const std::vector<int64_t>& dims, const std::vector<int64_t>& local_layers, double eps,
                       double query_factor) {
  TORCH_CHECK(dims.size() == 8,
              "register_stack: dims = [heads, kv_heads, head_dim, intermediate, dot, offset_norms, gelu, bf16]");
  TORCH_CHECK(tensors.size() % kPerLayer == 0 && kinds.size() * kPerLayer == tensors.size() * 4 && !tensors.empty(),
              "register_stack: 15 tensors and 4 kinds a layer, got ", tensors.size(), " and ", kinds.size());
  Stack s{{}, dims[0], dims[1], dims[2], dims[3], dims[4] != 0, tensors[2].numel() > 0, tensors[4].numel() > 0,
          tensors[5].numel() > 0, dims[5] != 0, dims[6] != 0, dims[7] ? at::kBFloat16 : at::kFloat, eps, query_factor,
          reinterpret_cast<eagle::AttentionTasks>(kernel_address("eagle::avx2_attention_tasks")),
          reinterpret_cast<eagle::AttentionSplitTasks>(kernel_address("eagle::avx2_attention_split_tasks")),
          reinterpret_cast<eagle::AttentionSplitPhase>(kernel_address("eagle::avx2_attention_split_phase"))};
  TORCH_CHECK((s.head_dim == 64 || s.head_dim == 128 || s.head_dim == 256) && s.heads % s.kv_heads == 0,
              "register_stack: head size 64, 128 or 256, heads a multiple of kv heads");
  const int64_t H = tensors[0].size(0);
  TORCH_CHECK(H % 8 == 0 && s.intermediate % 8 == 0, "register_stack: hidden and intermediate sizes multiples of 8");
  const int64_t outs[4] = {(s.heads + 2 * s.kv_heads) * s.head_dim, H, 2 * s.intermediate, H};
  const int64_t ins[4] = {H, s.heads * s.head_dim, H, s.intermediate};
  const auto dtype = s.dtype;
  const auto norm_dtype = s.offset_norms ? at::kFloat : dtype;
  auto of_dtype = [](const at::Tensor& x, int64_t n, at::ScalarType type) {  // a layer's vector: n values
    return x.scalar_type() == type && x.is_contiguous() && x.numel() == n;
  };
  auto of_layer = [&](const at::Tensor& x, int64_t n) { return of_dtype(x, n, dtype); };
  auto norm_of = [&](const at::Tensor& x, int64_t n) { return of_dtype(x, n, norm_dtype); };
  const int64_t L = static_cast<int64_t>(tensors.size() / kPerLayer);
  std::vector<bool> local(L, false);
  for (const int64_t l : local_layers) {
    TORCH_CHECK(l >= 0 && l < L, "register_stack: local layer ", l, " is not a layer of ", L);
    local[l] = true;
  }
  for (int64_t l = 0; l < L; l++) {
    const at::Tensor* t = tensors.data() + kPerLayer * l;
    TORCH_CHECK(norm_of(t[0], H) && norm_of(t[1], H), "register_stack: layer ", l, ": norms of ", H, " values in ",
                norm_dtype);
    TORCH_CHECK(s.qk_norm ? norm_of(t[2], s.head_dim) && norm_of(t[3], s.head_dim) : t[2].numel() + t[3].numel() == 0,
                "register_stack: layer ", l, ": query and key norms of ", s.head_dim, " values in ", norm_dtype,
                " in every layer, or in none");
    TORCH_CHECK(s.qkv_bias ? of_layer(t[4], outs[0]) : t[4].numel() == 0, "register_stack: layer ", l,
                ": a qkv bias of ", outs[0], " values in layer 0's dtype in every layer, or in none");
    TORCH_CHECK(s.sandwich ? norm_of(t[5], H) && norm_of(t[6], H) : t[5].numel() + t[6].numel() == 0,
                "register_stack: layer ", l, ": norms before and after the MLP of ", H, " values in ", norm_dtype,
                " in every layer, or in none");
    auto data = [](const at::Tensor& x) -> const void* { return x.numel() ? x.data_ptr() : nullptr; };
    Layer layer{t[0], t[1], t[2], t[3], t[4], t[5], t[6], {}, {}, {}, {},
                t[0].data_ptr(), t[1].data_ptr(), data(t[2]), data(t[3]), data(t[4]), data(t[5]), data(t[6]),
                local[l]};
    Linear* lin[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int j = 0; j < 4; j++) {
      const int64_t kind = kinds[4 * l + j];
      TORCH_CHECK(kind == kAvx2 || kind == kBf16 || kind == kInt8, "register_stack: unknown kernel ", kind);
      const at::Tensor& w = t[7 + 2 * j];
      const int64_t width = kind == kAvx2 ? 24 : 32;
      const bool packed = kind == kAvx2 ? w.dim() == 3 && w.size(1) == ins[j] && w.size(2) == width &&
                                              w.scalar_type() == at::kFloat
                                        : w.dim() == 4 && w.size(1) * 2 == ins[j] && w.size(2) == width &&
                                              w.scalar_type() == (kind == kInt8 ? at::kChar : at::kBFloat16);
      TORCH_CHECK(packed && w.is_contiguous() && w.size(0) * width >= outs[j], "register_stack: layer ", l,
                  " Linear ", j, ": packed weight ", w.sizes(), " ", w.scalar_type(), " does not hold ", outs[j],
                  " outputs of ", ins[j], " inputs for kernel ", kind);
      TORCH_CHECK(kind != kInt8 || (t[8 + 2 * j].scalar_type() == at::kFloat &&
                                    t[8 + 2 * j].numel() == w.size(0) * width),
                  "register_stack: int8 scales, fp32, one a packed column");
      const int64_t address = kind == kAvx2 ? kernel_address("eagle::avx2_linear_panels")
                                            : kernel_address("eagle::bf16_linear_panels", kind == kInt8);
      *lin[j] = Linear{kind, w, t[8 + 2 * j], outs[j], ins[j], reinterpret_cast<eagle::LinearPanels>(address), width,
                       w.data_ptr(), kind == kInt8 ? t[8 + 2 * j].data_ptr<float>() : nullptr};
    }
    s.layers.push_back(std::move(layer));
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.emplace(next_id, std::move(s));
  return next_id++;
}

void release_stack(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(id);
}

using eagle::load8;
using eagle::round8;
using eagle::store8;

// RMSNorm (model.RMSNorm): w * dtype(x * rsqrt(mean(x^2) + eps)), x in fp32, w in the model's dtype;
// with Gemma's offset dtype(x * rsqrt(mean(x^2) + eps) * w), w = 1 + weight in fp32 (offset). H a
// multiple of 8; y may be x.
template <typename scalar_t>
void rms_norm(const scalar_t* x, const void* weight, bool offset, scalar_t* y, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const scalar_t* xr = x + r * H;
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < H; i += 8) ss = _mm256_fmadd_ps(load8(xr + i), load8(xr + i), ss);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, ss);
    float sum = 0.f;
    for (float v : lanes) sum += v;
    const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(sum / H + eps));
    if (offset) {
      const float* w = static_cast<const float*>(weight);
      for (int64_t i = 0; i < H; i += 8)
        store8(y + r * H + i, _mm256_mul_ps(_mm256_mul_ps(load8(xr + i), inv), load8(w + i)));
    } else {
      const scalar_t* w = static_cast<const scalar_t*>(weight);
      for (int64_t i = 0; i < H; i += 8)
        store8(y + r * H + i, _mm256_mul_ps(load8(w + i), round8(_mm256_mul_ps(load8(xr + i), inv), xr)));
    }
  }
}

// x += y, rounded; n a multiple of 8
template <typename scalar_t>
void add_into(scalar_t* x, const scalar_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(x + i, _mm256_add_ps(load8(x + i), load8(y + i)));
}

// model.rotate of one head's row: x cos + cat(x2, x1) signed_sin, each product rounded
template <typename scalar_t>
void rotate_row(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, scalar_t* dst, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 a = round8(_mm256_mul_ps(load8(x + d), load8(cos + d)), x);
    const __m256 b = round8(_mm256_mul_ps(load8(x + (d + D / 2) % D), load8(sin + d)), x);
    store8(dst + d, _mm256_add_ps(a, b));
  }
}

// silu(gate) * up of rows [gate | up] of 2I values (model.MLP), silu rounded first
template <typename scalar_t>
void silu_mul(const scalar_t* gu, scalar_t* out, int64_t rows, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t r = 0; r < rows; r++) {
    const scalar_t* g = gu + r * 2 * I;
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 x = load8(g + i);
      const __m256 e = eagle::exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
      const __m256 silu = round8(_mm256_div_ps(x, _mm256_add_ps(one, e)), g);
      store8(out + r * I + i, _mm256_mul_ps(silu, load8(g + I + i)));
    }
  }
}

// gelu(gate) * up of rows [gate | up] of 2I values (model.MLP, Gemma's tanh GELU:
// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's), the GELU rounded first; tanh(u) =
// 1 - 2 / (exp(2u) + 1), with exp8 clamped so a large |u| gives +-1
template <typename scalar_t>
void gelu_mul(const scalar_t* gu, scalar_t* out, int64_t rows, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
  const __m256 beta = _mm256_set1_ps(0.7978845608028654f), kappa = _mm256_set1_ps(0.044715f);
  for (int64_t r = 0; r < rows; r++) {
    const scalar_t* g = gu + r * 2 * I;
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 x = load8(g + i);
      const __m256 u = _mm256_mul_ps(beta, _mm256_fmadd_ps(_mm256_mul_ps(kappa, x), _mm256_mul_ps(x, x), x));
      const __m256 e = eagle::exp8(_mm256_mul_ps(two, u));
      const __m256 tanh = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
      const __m256 gelu = round8(_mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh)), g);
      store8(out + r * I + i, _mm256_mul_ps(gelu, load8(g + I + i)));
    }
  }
}

// x *= f, rounded; n a multiple of 8 (Gemma's score scale on the rotated queries)
template <typename scalar_t>
void scale_into(scalar_t* x, float f, int64_t n) {
  const __m256 fv = _mm256_set1_ps(f);
  for (int64_t i = 0; i < n; i += 8) store8(x + i, _mm256_mul_ps(load8(x + i), fv));
}

// The input of Linear L for the calling thread: the bf16 kernels' FMA loop reads fp32, so a bf16
// model's rows are widened into the thread's own buffer (each thread does it for itself: no
// barrier); the other kernels read the rows as they are.
template <typename scalar_t>
const void* linear_input(const Linear& L, bool dot, const scalar_t* x, int64_t n, float* wide) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (L.kind != kAvx2 && !dot) {
      for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(wide + i, load8(x + i));
      return wide;
    }
  }
  return x;
}

template <typename scalar_t>
at::Tensor layers_impl(const Stack& s, const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& bias, const at::Tensor& local_cos, const at::Tensor& local_sin,
                       const at::Tensor& local_bias, const at::Tensor& write_index, at::Tensor& kv, int64_t row0,
                       int64_t B, const std::vector<int64_t>& taps) {
  const int64_t BT = x_in.size(0), H = x_in.size(1), T = BT / B, D = s.head_dim;
  const int64_t nh = s.heads, nkv = s.kv_heads, I = s.intermediate, S = bias.size(3), QKV = (nh + 2 * nkv) * D;
  const int64_t cache_rows = kv.size(2), max_seq = kv.size(4), L = static_cast<int64_t>(s.layers.size());
  const int64_t layer_rows = 2 * cache_rows * nkv * max_seq;  // one layer's cache as [-1, D]
  const float eps = static_cast<float>(s.eps);
  const auto opts = x_in.options();
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous(), bias_c = bias.contiguous();
  const at::Tensor lcos_c = local_cos.contiguous(), lsin_c = local_sin.contiguous(), lbias_c = local_bias.contiguous();
  // [B, T, 1, D] cos and signed sin (model.rope_at), [B, 1, T, S] bias: the full layers', the sliding ones'
  const scalar_t* const cps[2] = {cos_c.data_ptr<scalar_t>(), lcos_c.data_ptr<scalar_t>()};
  const scalar_t* const sps[2] = {sin_c.data_ptr<scalar_t>(), lsin_c.data_ptr<scalar_t>()};
  const void* const biases[2] = {bias_c.data_ptr(), lbias_c.data_ptr()};
  const float qf = static_cast<float>(s.query_factor);
  const int64_t* wi = write_index.data_ptr<int64_t>();  // [2 * B * nkv * T] (KVCache.write_index)
  scalar_t* kvp = kv.data_ptr<scalar_t>();
  at::Tensor out = at::empty({static_cast<int64_t>(1 + taps.size()), BT, H}, opts);
  // the residual stream: h (a layer's input, then its MLP's output) and g (h + attention)
  at::Tensor h_t = x_in.clone(at::MemoryFormat::Contiguous), g_t = at::empty({BT, H}, opts);
  at::Tensor xn_t = at::empty({BT, H}, opts), qkv_t = at::empty({BT, QKV}, opts), q_t = at::empty({B, nh, T, D}, opts);
  at::Tensor merged_t = at::empty({BT, nh * D}, opts), gu_t = at::empty({BT, 2 * I}, opts);
  at::Tensor act_t = at::empty({BT, I}, opts);
  scalar_t *h = h_t.data_ptr<scalar_t>(), *g = g_t.data_ptr<scalar_t>(), *xn = xn_t.data_ptr<scalar_t>();
  scalar_t *qkv = qkv_t.data_ptr<scalar_t>(), *q = q_t.data_ptr<scalar_t>(), *merged = merged_t.data_ptr<scalar_t>();
  scalar_t *gu = gu_t.data_ptr<scalar_t>(), *act = act_t.data_ptr<scalar_t>(), *outp = out.data_ptr<scalar_t>();
  std::vector<int64_t> tap_of(L, -1);  // layer -> its tap's index in out, or -1
  for (size_t i = 0; i < taps.size(); i++)
    if (taps[i] >= 0 && taps[i] < L) tap_of[taps[i]] = 1 + static_cast<int64_t>(i);
  const int threads = at::get_num_threads();
  const int64_t R = (nh / nkv) * T, chunks = eagle::attention_chunks(R, B, nkv, threads);
  const int64_t attention_tasks = B * nkv * chunks, widest = std::max({H, nh * D, I});
  const bool wide_inputs = std::is_same_v<scalar_t, at::BFloat16> && !s.dot;
  // layer l's attention of rows row0.. over its cache, each row's heads side by side in merged [BT, nh D]
  auto attention_of = [&](int64_t l) {
    const int64_t keys_at = ((2 * l * cache_rows) + row0) * nkv * max_seq * D;
    return eagle::AttentionCall{std::is_same_v<scalar_t, at::BFloat16>, q, kvp + keys_at,
                                kvp + keys_at + cache_rows * nkv * max_seq * D, biases[s.layers[l].local], merged,
                                B, nh, T, nkv, S, nkv * max_seq * D, max_seq * D, D, T * nh * D, D, nh * D,
                                chunks, D};
  };
  // the attention in halves (split_phase) where the threads would idle and the kernel can (its mode
  // and the cache's strides, the same for every layer)
  const int64_t split_tasks = eagle::split_attention(R, B, nkv, threads) ? s.split_tasks(attention_of(0)) : 0;
  std::vector<float> shared(split_tasks ? B * nkv * R * ((S + 15) / 16 * 16) : 0);
  // Where each (batch, kv head) is one task, the threads take them as they come free: a row reads
  // only the slots its sequence has (avx2_attention.cpp live_slots), and a batch's rows differ in
  // length by hundreds of slots, so equal shares of tasks would leave a thread waiting. Where a
  // pair's rows come in chunks (a verify at a small batch), equal shares of consecutive tasks keep
  // each pair's K and V read by one thread, mostly.
  std::vector<std::atomic<int64_t>> next_task(chunks == 1 ? L : 0);
  for (auto& next : next_task) next.store(0, std::memory_order_relaxed);

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    std::vector<float> scores(split_tasks ? 0 : (R + chunks - 1) / chunks * S), wide(wide_inputs ? BT * widest : 0);
    int64_t r0, r1;  // this thread's rows of the loops between the kernels
    eagle::thread_share(BT, t, n, r0, r1);
    // this thread's panels of y [BT, N] = x @ W.T
    auto linear = [&](const Linear& W, const scalar_t* x, scalar_t* y) {
      int64_t p0, p1;
      eagle::thread_share((W.out + W.width - 1) / W.width, t, n, p0, p1);
      const eagle::LinearCall call{linear_input(W, s.dot, x, BT * W.in, wide.data()), BT, W.in, W.w, W.s, y, W.out,
                                   s.dot};
      W.panels(call, p0, p1);
    };
    for (int64_t l = 0; l < L; l++) {
      const Layer& ly = s.layers[l];
      // h = g + the last layer's MLP output; its input norm
      if (l > 0) add_into(h + r0 * H, g + r0 * H, (r1 - r0) * H);
      if (tap_of[l] >= 0 && r1 > r0)
        std::memcpy(outp + (tap_of[l] * BT + r0) * H, h + r0 * H, (r1 - r0) * H * sizeof(scalar_t));
      rms_norm(h + r0 * H, ly.in_norm_data, s.offset_norms, xn + r0 * H, r1 - r0, H, eps);
#pragma omp barrier
      linear(ly.qkv, xn, qkv);  // [BT, (nh + 2 nkv) D]
#pragma omp barrier
      // the bias (Qwen2), each head's query / key norm (Qwen3, Gemma 3), then RoPE on q (into q [B,
      // nh, T, D], times the score scale where it has one) and k (into its cache row), v into its
      // cache row
      scalar_t* layer_kv = kvp + l * layer_rows * D;
      const scalar_t *cp = cps[ly.local], *sp = sps[ly.local];
      for (int64_t bt = r0; bt < r1; bt++) {
        const int64_t b = bt / T, tt = bt % T;
        scalar_t* row = qkv + bt * QKV;
        if (s.qkv_bias) add_into(row, static_cast<const scalar_t*>(ly.qkv_bias_data), QKV);
        if (s.qk_norm) {
          rms_norm(row, ly.q_norm_data, s.offset_norms, row, nh, D, eps);
          rms_norm(row + nh * D, ly.k_norm_data, s.offset_norms, row + nh * D, nkv, D, eps);
        }
        for (int64_t hh = 0; hh < nh + nkv; hh++) {
          scalar_t* dst = hh < nh ? q + ((b * nh + hh) * T + tt) * D : layer_kv + wi[(b * nkv + hh - nh) * T + tt] * D;
          rotate_row(row + hh * D, cp + bt * D, sp + bt * D, dst, D);
          if (hh < nh && qf != 1.f) scale_into(dst, qf, D);
        }
        for (int64_t hh = 0; hh < nkv; hh++)
          std::memcpy(layer_kv + wi[((B + b) * nkv + hh) * T + tt] * D, row + (nh + nkv + hh) * D, D * sizeof(scalar_t));
      }
#pragma omp barrier
      const eagle::AttentionCall attention = attention_of(l);
      int64_t a0, a1;
      if (split_tasks) {
        eagle::thread_share(split_tasks, t, n, a0, a1);
        s.split_phase(attention, 1, a0, a1, shared.data());
#pragma omp barrier
        s.split_phase(attention, 2, a0, a1, shared.data());
      } else if (chunks == 1) {
        for (int64_t a = next_task[l]++; a < attention_tasks; a = next_task[l]++)
          s.attention(attention, a, a + 1, scores.data());
      } else {
        eagle::thread_share(attention_tasks, t, n, a0, a1);
        s.attention(attention, a0, a1, scores.data());
      }
#pragma omp barrier
      linear(ly.o, merged, g);  // [BT, H]
#pragma omp barrier
      // g = h + o (o normed first with sandwich norms; addition commutes exactly); the MLP: norm,
      // gate and up, silu(gate) * up (or tanh GELU's), down
      if (s.sandwich) rms_norm(g + r0 * H, ly.post_norm_data, s.offset_norms, g + r0 * H, r1 - r0, H, eps);
      add_into(g + r0 * H, h + r0 * H, (r1 - r0) * H);
      rms_norm(g + r0 * H, s.sandwich ? ly.pre_ffn_norm_data : ly.post_norm_data, s.offset_norms, xn + r0 * H, r1 - r0,
               H, eps);
#pragma omp barrier
      linear(ly.gate_up, xn, gu);  // [BT, 2I]
#pragma omp barrier
      if (s.gelu)
        gelu_mul(gu + r0 * 2 * I, act + r0 * I, r1 - r0, I);
      else
        silu_mul(gu + r0 * 2 * I, act + r0 * I, r1 - r0, I);
#pragma omp barrier
      linear(ly.down, act, h);  // [BT, H]
#pragma omp barrier
      // with sandwich norms the MLP's output normed (this thread's rows: the next add is this thread's too)
      if (s.sandwich) rms_norm(h + r0 * H, ly.post_ffn_norm_data, s.offset_norms, h + r0 * H, r1 - r0, H, eps);
    }
    add_into(h + r0 * H, g + r0 * H, (r1 - r0) * H);
    if (r1 > r0) std::memcpy(outp + r0 * H, h + r0 * H, (r1 - r0) * H * sizeof(scalar_t));
  }
  return out;
}

// x [B*T, H] (embeddings) -> [1 + len(taps), B*T, H]: x after the last layer, then the inputs of
// layers `taps`;
// cos, signed sin [B, T, 1, D] (model.rope_at), bias [B, 1, T, S] additive mask, and the sliding
// layers' own (local_cos, local_sin, local_bias: the same tensors where the target has none),
// write_index [2 * B * kv_heads * T] (KVCache.write_index) into each layer's cache, kv [layers, 2,
// rows, kv_heads, max_seq, D] (KVCache.kv) written there; batch row b reads cache row row0 + b.
at::Tensor decoder_layers(const at::Tensor& handle, const at::Tensor& x, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& bias, const at::Tensor& local_cos,
                          const at::Tensor& local_sin, const at::Tensor& local_bias, const at::Tensor& write_index,
                          at::Tensor& kv, int64_t row0, int64_t batch, std::vector<int64_t> taps) {
  // The id comes in a tensor: an int argument would be a constant of each compiled graph, and a
  // graph compiled for stack 1 would miss the compile cache in a process whose target is stack 2.
  TORCH_CHECK(handle.numel() == 1 && handle.scalar_type() == at::kLong && handle.device().is_cpu(),
              "decoder_layers: the stack's id as one int64 CPU value (Stack.handle)");
  const int64_t id = *handle.data_ptr<int64_t>();
  const Stack* s;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    const auto it = registry.find(id);
    TORCH_CHECK(it != registry.end(), "decoder_layers: no registered stack ", id);
    s = &it->second;
  }
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decoder_layers: fp32 or bf16, got ", dtype);
  TORCH_CHECK(x.dim() == 2 && batch > 0 && x.size(0) % batch == 0, "decoder_layers: x [B*T, H], got ", x.sizes());
  const int64_t BT = x.size(0), T = BT / batch, D = s->head_dim;
  const at::Tensor& norm = s->layers[0].in_norm;
  TORCH_CHECK(x.size(1) == norm.size(0) && s->dtype == dtype, "decoder_layers: x [B*T, ", norm.size(0),
              "] in the stack's dtype ", s->dtype, ", got ", x.sizes(), " ", dtype);
  for (const at::Tensor* t : {&cos, &sin, &bias, &local_cos, &local_sin, &local_bias, static_cast<const at::Tensor*>(&kv)})
    TORCH_CHECK(t->scalar_type() == dtype, "decoder_layers: cos, sin, bias (local ones too) and kv in x's dtype");
  TORCH_CHECK(cos.numel() == BT * D && sin.numel() == BT * D && local_cos.numel() == BT * D &&
                  local_sin.numel() == BT * D,
              "decoder_layers: cos, sin (local ones too) [B, T, 1, ", D, "], got ", cos.sizes(), " ", local_cos.sizes());
  TORCH_CHECK(bias.dim() == 4 && bias.size(0) == batch && bias.size(2) == T && local_bias.sizes() == bias.sizes(),
              "decoder_layers: bias and local bias [B, 1, T, S], got ", bias.sizes(), " ", local_bias.sizes());
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 6 && kv.size(0) == static_cast<int64_t>(s->layers.size()) &&
                  kv.size(1) == 2 && kv.size(3) == s->kv_heads &&
                  kv.size(5) == D && row0 >= 0 && row0 + batch <= kv.size(2) && bias.size(3) <= kv.size(4),
              "decoder_layers: kv [layers, 2, rows, kv_heads, max_seq, D] for these rows, got ", kv.sizes());
  TORCH_CHECK(write_index.scalar_type() == at::kLong && write_index.is_contiguous() &&
                  write_index.numel() == 2 * BT * s->kv_heads,
              "decoder_layers: write_index [2 * B * kv_heads * T] int64");
  for (const int64_t tap : taps)
    TORCH_CHECK(tap >= 0 && tap < kv.size(0), "decoder_layers: tap ", tap, " is not a layer of ", kv.size(0));
  const int64_t layer_rows = 2 * kv.size(2) * kv.size(3) * kv.size(4);
  const int64_t* wi = write_index.data_ptr<int64_t>();
  for (int64_t i = 0; i < write_index.numel(); i++)
    TORCH_CHECK(wi[i] >= 0 && wi[i] < layer_rows, "decoder_layers: write index ", wi[i], " outside the cache");
  if (dtype == at::kFloat)
    return layers_impl<float>(*s, x, cos, sin, bias, local_cos, local_sin, local_bias, write_index, kv, row0, batch,
                              taps);
  return layers_impl<at::BFloat16>(*s, x, cos, sin, bias, local_cos, local_sin, local_bias, write_index, kv, row0,
                                   batch, taps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("register_stack(Tensor[] tensors, int[] kinds, int[] dims, int[] local_layers, float eps, float query_factor) "
        "-> int", &register_stack);
  m.def("release_stack(int id) -> ()", &release_stack);
  m.def(
      "decoder_layers(Tensor id, Tensor x, Tensor cos, Tensor sin, Tensor bias, Tensor local_cos, Tensor local_sin, "
      "Tensor local_bias, Tensor write_index, Tensor(a!) kv, int row0, int batch, int[] taps) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("decoder_layers", &decoder_layers);
}
