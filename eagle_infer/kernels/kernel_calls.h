// How decoder_layers.cpp calls the Linear and attention kernels of the other libraries from inside
// its own parallel region: each kernel library exports a function that computes a range of its
// work (a Linear's panels, the attention's tasks) on the calling thread, and an op that returns
// that function's address (the libraries are built apart, with their own ISA flags, so one cannot
// link against another). The op entry points run the same functions over at::parallel_for.
// (kernels/avx2_linear.build folds the hash of every header here into the build flags.)
#pragma once

#include <cstdint>

namespace eagle {

// y [M, N] = x [M, K] @ W.T through a packed weight: x fp32 for the fp32 kernels and the bf16
// ones' FMA loop, bf16 for vdpbf16ps (dot); y in the model's dtype; scale: int8 weights' column
// scales, else nullptr. K is the packed weight's (even for the bf16 kernels).
struct LinearCall {
  const void* x;
  int64_t M, K;
  const void* w;
  const float* scale;
  void* y;
  int64_t N;
  bool dot;
};

// Computes panels p0..p1 (each `width` columns, the kernel's) of a LinearCall.
using LinearPanels = void (*)(const LinearCall& call, int64_t p0, int64_t p1);

// out[b, h, t] = softmax(q[b, h, t] . K[b, h / G]^T / sqrt(D) + bias[b, 0, t]) V[b, h / G], D 64, 128 or 256,
// in the cache's dtype (bf16 = true: bf16, else fp32). q [B, H, T, D] and bias [B, 1, T, S]
// contiguous; K and V rows `row` apart, kv heads `head` apart, batch rows `batch` apart (one cache's
// strides); out[b, h, t] at out + b * out_b + h * out_h + t * out_t. Work: B * KVH * chunks
// tasks (a chunk: a share of a kv head's G * T rows; attention_chunks).
struct AttentionCall {
  bool bf16;
  const void *q, *k, *v, *bias;
  void* out;
  int64_t B, H, T, KVH, S;
  int64_t batch, head, row;
  int64_t out_b, out_h, out_t;
  int64_t chunks;
  int64_t D;  // the head size
};

// Computes tasks t0..t1 of an AttentionCall; scores: fp32 scratch of the calling thread, of at
// least ceil(G * T / chunks) * S values.
using AttentionTasks = void (*)(const AttentionCall& call, int64_t t0, int64_t t1, float* scores);

// How many chunks a kv head's R = G * T rows split into: only while there are fewer (batch, kv
// head) pairs than twice the threads (a verify at batch 1: 3 kv heads, 2 threads), and not below
// 8 rows: each chunk reads the kv head's K and V, which a step meets cold (they come from memory),
// so a one-row step at batch 1 ran 1.25x faster as 3 tasks than as 6, the threads' imbalance
// notwithstanding (1,200 slots, 30 layers' caches read cold, the two builds alternating, 2-core
// Zen 4: 96 against 124 us a layer on the loops, 109 against 137 on vdpbf16ps).
inline int64_t attention_chunks(int64_t R, int64_t B, int64_t KVH, int64_t threads) {
  if (R < 8) return 1;
  const int64_t want = (2 * threads + B * KVH - 1) / (B * KVH);
  return want < 1 ? 1 : (want < R ? want : R);
}

// Whether a call whose kv heads' rows do not split into chunks (attention_chunks: 1) runs in two
// phases, each in halves of every (batch, kv head) (avx2_attention.cpp split_phase): where those
// pairs do not divide among the threads (a decode step at batch 1: 3 kv heads on 2 threads).
inline bool split_attention(int64_t R, int64_t B, int64_t KVH, int64_t threads) {
  return R < 8 && threads > 1 && (B * KVH) % threads != 0;
}

// A split call's tasks a phase (0: the call does not split so: attention_tasks instead), and tasks
// t0..t1 of phase 1 or 2; `shared`: the scores of phase 1 for phase 2, B * KVH * (H / KVH) * T * S16
// floats (S16: S rounded up to a multiple of 16). Phase 2 may start once every phase-1 task is done.
using AttentionSplitTasks = int64_t (*)(const AttentionCall& call);
using AttentionSplitPhase = void (*)(const AttentionCall& call, int64_t phase, int64_t t0, int64_t t1, float* shared);

// The share [begin, end) of n work items of thread `t` of `threads`: at::parallel_for's static split
// (ceil(n / threads) each, in order).
inline void thread_share(int64_t n, int t, int threads, int64_t& begin, int64_t& end) {
  const int64_t each = (n + threads - 1) / threads;
  begin = t * each < n ? t * each : n;
  end = begin + each < n ? begin + each : n;
}

}  // namespace eagle
