// The decoder layers of a Llama-family target (no biases, head size 64) as one call per step on a
// CPU: what model.DecoderLayer computes, layer after layer, for a decode step's row or a verify's
// tree of rows, with the Linears and the attention on our kernels (bf16_linear.cpp,
// avx2_linear.cpp, avx2_attention.cpp, called through the dispatcher) and the norms, RoPE, cache
// writes, SiLU and residual adds as AVX2 loops in between, each rounded to the model's dtype where
// model.py's eager ops round.
//
// Why: a compiled step of the 30-layer default target runs ~150 kernel calls and ~100 small
// Inductor kernels, and Dynamo checks ~300 weight tensors' guards before each: on a 2-core Zen 4 with
// int8 weights ~2.4 ms of a 8.0 ms step ran on the main thread outside any kernel while the other
// thread waited (perf). The weights are registered once (register_stack) and a step names them
// by a handle, so a compiled step neither passes nor guards them.
//
// A row's result never depends on the rows beside it (each kernel's rows are independent and the
// loops here are per row), so a verify's rows equal one-row steps'.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "avx2_math.h"

namespace {

enum Kind : int64_t { kAvx2 = 0, kBf16 = 1, kInt8 = 2 };  // the Linear kernel of a weight

struct Linear {
  int64_t kind;
  at::Tensor weight, scale;  // packed weight; int8: its panel scales
  int64_t out;
};

struct Layer {
  at::Tensor in_norm, post_norm;  // [H]
  Linear qkv, o, gate_up, down;
};

struct Stack {
  std::vector<Layer> layers;
  int64_t heads, kv_heads, head_dim, intermediate;
  bool dot;
  double eps;
};

std::mutex registry_mutex;
std::unordered_map<int64_t, Stack> registry;
int64_t next_id = 1;

// tensors: per layer in_norm, post_norm, then (packed weight, scale) for qkv, o, gate_up, down
// (scale: an empty tensor but for int8); kinds: per layer the four Linears' Kind; dims: heads,
// kv heads, head size, intermediate size, dot (bf16_linear's vdpbf16ps flag).
int64_t register_stack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& kinds,
                       const std::vector<int64_t>& dims, double eps) {
  TORCH_CHECK(dims.size() == 5, "register_stack: dims = [heads, kv_heads, head_dim, intermediate, dot]");
  TORCH_CHECK(tensors.size() % 10 == 0 && kinds.size() * 10 == tensors.size() * 4 && !tensors.empty(),
              "register_stack: 10 tensors and 4 kinds a layer, got ", tensors.size(), " and ", kinds.size());
  Stack s{{}, dims[0], dims[1], dims[2], dims[3], dims[4] != 0, eps};
  TORCH_CHECK(s.head_dim == 64 && s.heads % s.kv_heads == 0, "register_stack: head size 64, heads a multiple of kv heads");
  const int64_t H = tensors[0].size(0);
  TORCH_CHECK(H % 8 == 0 && s.intermediate % 8 == 0, "register_stack: hidden and intermediate sizes multiples of 8");
  const int64_t outs[4] = {(s.heads + 2 * s.kv_heads) * s.head_dim, H, 2 * s.intermediate, H};
  for (size_t l = 0; l < tensors.size() / 10; l++) {
    const at::Tensor* t = tensors.data() + 10 * l;
    Layer layer{t[0], t[1], {}, {}, {}, {}};
    Linear* lin[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int j = 0; j < 4; j++) {
      const int64_t kind = kinds[4 * l + j];
      TORCH_CHECK(kind == kAvx2 || kind == kBf16 || kind == kInt8, "register_stack: unknown kernel ", kind);
      *lin[j] = Linear{kind, t[2 + 2 * j], t[3 + 2 * j], outs[j]};
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

at::Tensor run_linear(const Linear& L, const at::Tensor& x, bool dot) {
  using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
  using Bf16Fn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool);
  using Int8Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool);
  auto& d = c10::Dispatcher::singleton();
  switch (L.kind) {
    case kAvx2: {
      static const auto op = d.findSchemaOrThrow("eagle::avx2_linear", "").typed<LinearFn>();
      return op.call(x, L.weight, L.out);
    }
    case kBf16: {
      static const auto op = d.findSchemaOrThrow("eagle::bf16_linear", "").typed<Bf16Fn>();
      return op.call(x, L.weight, L.out, dot);
    }
    default: {
      static const auto op = d.findSchemaOrThrow("eagle::int8_linear", "").typed<Int8Fn>();
      return op.call(x, L.weight, L.scale, L.out, dot);
    }
  }
}

at::Tensor run_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& bias) {
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("eagle::avx2_attention", "").typed<Fn>();
  return op.call(q, keys, values, bias);
}

using eagle::load8;
using eagle::round8;
using eagle::store8;

// RMSNorm (model.RMSNorm): w * dtype(x * rsqrt(mean(x^2) + eps)), x in fp32; H a multiple of 8
template <typename scalar_t>
void rms_norm(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const scalar_t* xr = x + r * H;
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < H; i += 8) ss = _mm256_fmadd_ps(load8(xr + i), load8(xr + i), ss);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, ss);
    float sum = 0.f;
    for (float v : lanes) sum += v;
    const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(sum / H + eps));
    for (int64_t i = 0; i < H; i += 8)
      store8(y + r * H + i, _mm256_mul_ps(load8(w + i), round8(_mm256_mul_ps(load8(xr + i), inv), xr)));
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

template <typename scalar_t>
at::Tensor layers_impl(const Stack& s, const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& bias, const at::Tensor& write_index, at::Tensor& kv, int64_t row0,
                       int64_t B, const std::vector<int64_t>& taps) {
  const int64_t BT = x_in.size(0), H = x_in.size(1), T = BT / B, D = s.head_dim;
  const int64_t nh = s.heads, nkv = s.kv_heads, I = s.intermediate, S = bias.size(3);
  const int64_t cache_rows = kv.size(2), max_seq = kv.size(4);
  const int64_t layer_rows = 2 * cache_rows * nkv * max_seq;  // one layer's cache as [-1, D]
  const float eps = static_cast<float>(s.eps);
  const auto opts = x_in.options();
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous(), bias_c = bias.contiguous();
  const scalar_t* cp = cos_c.data_ptr<scalar_t>();  // [B, T, 1, D]
  const scalar_t* sp = sin_c.data_ptr<scalar_t>();  // signed sin (model.rope_at)
  const int64_t* wi = write_index.data_ptr<int64_t>();  // [2 * B * nkv * T] (KVCache.write_index)
  scalar_t* kvp = kv.data_ptr<scalar_t>();
  at::Tensor out = at::empty({static_cast<int64_t>(1 + taps.size()), BT, H}, opts);
  at::Tensor x = x_in.contiguous();
  at::Tensor xn = at::empty({BT, H}, opts), q = at::empty({B, nh, T, D}, opts);
  at::Tensor act = at::empty({BT, I}, opts), merged = at::empty({BT, nh * D}, opts);
  for (int64_t l = 0; l < static_cast<int64_t>(s.layers.size()); l++) {
    for (size_t i = 0; i < taps.size(); i++)
      if (taps[i] == l) out[1 + i].copy_(x);
    const Layer& ly = s.layers[l];
    // attention: norm, q k v, RoPE on q and k, k and v into the cache, attention, o, residual
    rms_norm(x.data_ptr<scalar_t>(), ly.in_norm.data_ptr<scalar_t>(), xn.data_ptr<scalar_t>(), BT, H, eps);
    const at::Tensor qkv = run_linear(ly.qkv, xn, s.dot);  // [BT, (nh + 2 nkv) D]
    const scalar_t* qkvp = qkv.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* layer_kv = kvp + l * layer_rows * D;
    for (int64_t b = 0; b < B; b++) {
      for (int64_t t = 0; t < T; t++) {
        const scalar_t* row = qkvp + (b * T + t) * (nh + 2 * nkv) * D;
        const scalar_t* c = cp + (b * T + t) * D;
        const scalar_t* sn = sp + (b * T + t) * D;
        for (int64_t h = 0; h < nh + nkv; h++)  // q into q [B, nh, T, D], k into its cache row
          rotate_row(row + h * D, c, sn,
                     h < nh ? qp + ((b * nh + h) * T + t) * D : layer_kv + wi[(b * nkv + h - nh) * T + t] * D, D);
        for (int64_t h = 0; h < nkv; h++)  // v
          std::memcpy(layer_kv + wi[((B + b) * nkv + h) * T + t] * D, row + (nh + nkv + h) * D, D * sizeof(scalar_t));
      }
    }
    // this layer's keys and values of rows row0.., [B, nkv, S, D] views (one op each, not four)
    const int64_t keys_at = ((2 * l * cache_rows) + row0) * nkv * max_seq * D;
    const at::Tensor keys = kv.as_strided({B, nkv, S, D}, {nkv * max_seq * D, max_seq * D, D, 1}, keys_at);
    const at::Tensor values = kv.as_strided({B, nkv, S, D}, {nkv * max_seq * D, max_seq * D, D, 1},
                                            keys_at + cache_rows * nkv * max_seq * D);
    const at::Tensor attn = run_attention(q, keys, values, bias_c);  // [B, nh, T, D]
    const scalar_t* ap = attn.data_ptr<scalar_t>();
    scalar_t* mp = merged.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; b++)
      for (int64_t h = 0; h < nh; h++)
        for (int64_t t = 0; t < T; t++)
          std::memcpy(mp + ((b * T + t) * nh + h) * D, ap + ((b * nh + h) * T + t) * D, D * sizeof(scalar_t));
    at::Tensor x1 = run_linear(ly.o, merged, s.dot);  // [BT, H]
    add_into(x1.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), BT * H);  // x + o (addition commutes exactly)
    // MLP: norm, gate and up, silu(gate) * up, down, residual
    rms_norm(x1.data_ptr<scalar_t>(), ly.post_norm.data_ptr<scalar_t>(), xn.data_ptr<scalar_t>(), BT, H, eps);
    const at::Tensor gu = run_linear(ly.gate_up, xn, s.dot);  // [BT, 2I]
    silu_mul(gu.data_ptr<scalar_t>(), act.data_ptr<scalar_t>(), BT, I);
    at::Tensor x2 = run_linear(ly.down, act, s.dot);  // [BT, H]
    add_into(x2.data_ptr<scalar_t>(), x1.data_ptr<scalar_t>(), BT * H);
    x = x2;
  }
  out[0].copy_(x);
  return out;
}

// x [B*T, H] (embeddings) -> [1 + len(taps), B*T, H]: x after the last layer, then the inputs of
// layers `taps`;
// cos, signed sin [B, T, 1, D] (model.rope_at), bias [B, 1, T, S] additive mask, write_index
// [2 * B * kv_heads * T] (KVCache.write_index) into each layer's cache, kv [layers, 2, rows, kv_heads,
// max_seq, D] (KVCache.kv) written there; batch row b reads cache row row0 + b.
at::Tensor decoder_layers(int64_t id, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& bias, const at::Tensor& write_index, at::Tensor& kv, int64_t row0,
                          int64_t batch, std::vector<int64_t> taps) {
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
  TORCH_CHECK(x.size(1) == norm.size(0) && norm.scalar_type() == dtype, "decoder_layers: x [B*T, ", norm.size(0),
              "] in the stack's dtype ", norm.scalar_type(), ", got ", x.sizes(), " ", dtype);
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && bias.scalar_type() == dtype &&
                  kv.scalar_type() == dtype,
              "decoder_layers: cos, sin, bias and kv in x's dtype");
  TORCH_CHECK(cos.numel() == BT * D && sin.numel() == BT * D,
              "decoder_layers: cos, sin [B, T, 1, ", D, "], got ", cos.sizes());
  TORCH_CHECK(bias.dim() == 4 && bias.size(0) == batch && bias.size(2) == T, "decoder_layers: bias [B, 1, T, S], got ",
              bias.sizes());
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 6 && kv.size(0) == static_cast<int64_t>(s->layers.size()) &&
                  kv.size(1) == 2 && kv.size(3) == s->kv_heads &&
                  kv.size(5) == D && row0 >= 0 && row0 + batch <= kv.size(2) && bias.size(3) <= kv.size(4),
              "decoder_layers: kv [layers, 2, rows, kv_heads, max_seq, D] for these rows, got ", kv.sizes());
  TORCH_CHECK(write_index.scalar_type() == at::kLong && write_index.is_contiguous() &&
                  write_index.numel() == 2 * BT * s->kv_heads,
              "decoder_layers: write_index [2 * B * kv_heads * T] int64");
  const int64_t layer_rows = 2 * kv.size(2) * kv.size(3) * kv.size(4);
  const int64_t* wi = write_index.data_ptr<int64_t>();
  for (int64_t i = 0; i < write_index.numel(); i++)
    TORCH_CHECK(wi[i] >= 0 && wi[i] < layer_rows, "decoder_layers: write index ", wi[i], " outside the cache");
  if (dtype == at::kFloat) return layers_impl<float>(*s, x, cos, sin, bias, write_index, kv, row0, batch, taps);
  return layers_impl<at::BFloat16>(*s, x, cos, sin, bias, write_index, kv, row0, batch, taps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("register_stack(Tensor[] tensors, int[] kinds, int[] dims, float eps) -> int", &register_stack);
  m.def("release_stack(int id) -> ()", &release_stack);
  m.def(
      "decoder_layers(int id, Tensor x, Tensor cos, Tensor sin, Tensor bias, Tensor write_index, Tensor(a!) kv, "
      "int row0, int batch, int[] taps) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("decoder_layers", &decoder_layers);
}
