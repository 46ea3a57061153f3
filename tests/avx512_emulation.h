// The AVX-512 (AVX512-BF16) and AMX intrinsics that kernels/bf16_linear.cpp's AVX-512 build calls,
// in plain C++ on AVX2, so that its code paths (fp32 FMAs, vdpbf16ps, AMX tiles; bf16 and int8
// weights; every tile shape, chunks of k, blocks of 16 rows) run and are checked on any x86 CPU:
// the sessions and CI machines here are mostly AVX2-only, and a refactor of that build would
// otherwise first run on a user's machine. tests/test_bf16_linear_emulated.py builds a copy of
// the kernel with `-include` this file (which also declares the build's macro, __AVX512BF16__).
//
// Semantics are the Intel SDM's pseudo-code: vdpbf16ps adds the odd bf16 pair's product, then the
// even one's, each an fp32 FMA rounded to nearest even (the products of two bf16 are exact in
// fp32); TDPBF16PS adds, per k pair in order, the even product then the odd one; both treat
// denormal inputs as zero and flush denormal results (DAZ, FTZ), as does vcvtneps2bf16 for its
// inputs. The tiles check their configuration as the hardware does (a mismatch is #UD there, an
// exception here). Real AMX hardware is not bound to this rounding order: the emulation checks
// the kernel's indexing and data flow, not the silicon's last bit.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#define __AVX512BF16__ 1  // the kernel's AVX-512 build, here with the functions below
#define EAGLE_EMULATED_AMX 1  // amx.h: amx_usable() is true (the tiles below)

namespace eagle_emu {

typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int16_t i16x32 __attribute__((vector_size(64)));
typedef int8_t i8x32 __attribute__((vector_size(32)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

template <typename To, typename From>
inline To bits(const From& v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &v, sizeof(t));
  return t;
}

inline float daz(float f) { return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.0f, f) : f; }
inline float bf16_to_float(uint16_t h) { return daz(bits<float>(static_cast<uint32_t>(h) << 16)); }

// vcvtneps2bf16: round to nearest even; NaNs quieted; denormal inputs as signed zero.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = bits<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  if (std::fpclassify(f) == FP_SUBNORMAL) return static_cast<uint16_t>((u >> 16) & 0x8000);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline __m512 setzero_ps() { return __m512{}; }
inline __m512 set1_ps(float f) { return __m512{} + f; }
inline __m512i set1_epi32(int32_t i) { return (__m512i)(i32x16{} + i); }
inline __m512i loadu_si512(const void* p) { __m512i v; std::memcpy(&v, p, 64); return v; }
inline __m512 loadu_ps(const float* p) { __m512 v; std::memcpy(&v, p, 64); return v; }
inline __m512 load_ps(const float* p) {
  if (reinterpret_cast<uintptr_t>(p) % 64) throw std::runtime_error("_mm512_load_ps: address not 64-byte aligned");
  return loadu_ps(p);
}
inline void store_si512(void* p, __m512i v) {
  if (reinterpret_cast<uintptr_t>(p) % 64) throw std::runtime_error("_mm512_store_si512: address not 64-byte aligned");
  std::memcpy(p, &v, 64);
}
inline __m512 castsi512_ps(__m512i v) { return (__m512)v; }
inline __m512i slli_epi32(__m512i v, unsigned n) { return n > 31 ? __m512i{} : (__m512i)((u32x16)v << n); }
inline __m512i srai_epi32(__m512i v, unsigned n) { return (__m512i)((i32x16)v >> (n > 31 ? 31 : n)); }
inline __m512i and_si512(__m512i a, __m512i b) { return a & b; }
inline __m512 mul_ps(__m512 a, __m512 b) { return a * b; }
inline __m512 cvtepi32_ps(__m512i v) { return __builtin_convertvector((i32x16)v, __m512); }
inline __m512i cvtepi8_epi16(__m256i v) { return (__m512i)__builtin_convertvector((i8x32)v, i16x32); }
inline __m512i cvtepi8_epi32(__m128i v) { return (__m512i)__builtin_convertvector((i8x16)v, i32x16); }

// FMAs lane by lane on the AVX2 unit: one rounding, as the AVX-512 instruction.
inline __m512 fmadd_ps(__m512 a, __m512 b, __m512 c) {
  __m256 x[2], y[2], z[2];
  std::memcpy(x, &a, 64), std::memcpy(y, &b, 64), std::memcpy(z, &c, 64);
  z[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
  z[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
  return bits<__m512>(z);
}

inline __m256bh cvtneps_pbh(__m512 a) {
  float f[16];
  uint16_t h[16];
  std::memcpy(f, &a, 64);
  for (int i = 0; i < 16; i++) h[i] = float_to_bf16(f[i]);
  return bits<__m256bh>(h);
}

// Lanes 0-15 from b, 16-31 from a.
inline __m512bh cvtne2ps_pbh(__m512 a, __m512 b) {
  struct { __m256bh lo, hi; } r{cvtneps_pbh(b), cvtneps_pbh(a)};
  return bits<__m512bh>(r);
}

inline float fma_ftz(float a, float b, float c) { return daz(std::fma(a, b, c)); }

// vdpbf16ps src, a, b: each fp32 lane j += a[2j + 1] * b[2j + 1], then += a[2j] * b[2j].
inline __m512 dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  float acc[16];
  uint16_t x[32], y[32];
  std::memcpy(acc, &src, 64), std::memcpy(x, &a, 64), std::memcpy(y, &b, 64);
  for (int j = 0; j < 16; j++) {
    const float s = fma_ftz(bf16_to_float(x[2 * j + 1]), bf16_to_float(y[2 * j + 1]), daz(acc[j]));
    acc[j] = fma_ftz(bf16_to_float(x[2 * j]), bf16_to_float(y[2 * j]), s);
  }
  return bits<__m512>(acc);
}

// AMX: 8 tiles of up to 16 rows of 64 bytes a thread, as ldtilecfg configured them.
struct Tiles {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};
inline thread_local Tiles tiles;

[[noreturn]] inline void fault(const std::string& what) { throw std::runtime_error("emulated AMX: " + what); }

inline void check_tile(int t) {
  if (!tiles.configured) fault("tile instruction before ldtilecfg");
  if (t < 0 || t >= 8) fault("tile " + std::to_string(t) + " out of range");
  if (tiles.rows[t] == 0 || tiles.colsb[t] == 0) fault("tile " + std::to_string(t) + " is not configured");
}

// ldtilecfg's 64-byte operand: palette (byte 0), bytes a row of each tile (16-47), rows (48-63).
inline void tile_loadconfig(const void* config) {
  const auto* c = static_cast<const uint8_t*>(config);
  if (c[0] != 1) fault("palette " + std::to_string(c[0]) + " (only palette 1 exists)");
  for (int t = 0; t < 8; t++) {
    std::memcpy(&tiles.colsb[t], c + 16 + 2 * t, 2);
    tiles.rows[t] = c[48 + t];
    if (tiles.rows[t] > 16 || tiles.colsb[t] > 64 || tiles.colsb[t] % 4)
      fault("tile " + std::to_string(t) + ": " + std::to_string(tiles.rows[t]) + " rows of " +
            std::to_string(tiles.colsb[t]) + " bytes");
  }
  std::memset(tiles.data, 0, sizeof(tiles.data));
  tiles.configured = true;
}

inline void tile_zero(int t) {
  check_tile(t);
  std::memset(tiles.data[t], 0, sizeof(tiles.data[t]));
}

inline void tile_loadd(int t, const void* base, int64_t stride) {
  check_tile(t);
  std::memset(tiles.data[t], 0, sizeof(tiles.data[t]));  // rows and bytes past the configured: zero
  for (int r = 0; r < tiles.rows[t]; r++)
    std::memcpy(tiles.data[t][r], static_cast<const uint8_t*>(base) + r * stride, tiles.colsb[t]);
}

inline void tile_stored(int t, void* base, int64_t stride) {
  check_tile(t);
  for (int r = 0; r < tiles.rows[t]; r++)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles.data[t][r], tiles.colsb[t]);
}

// TDPBF16PS c, a, b: c [M, N] fp32 += a [M, K pairs] . b [K pairs, N pairs], per k pair the even
// product, then the odd one. Shapes as the hardware demands: M = a's rows, K = b's rows, N = c's.
inline void tile_dpbf16ps(int c, int a, int b) {
  check_tile(c), check_tile(a), check_tile(b);
  const int M = tiles.rows[c], N = tiles.colsb[c] / 4, K = tiles.colsb[a] / 4;
  if (tiles.rows[a] != M || tiles.rows[b] != K || tiles.colsb[b] != tiles.colsb[c])
    fault("tdpbf16ps shapes: c " + std::to_string(M) + "x" + std::to_string(tiles.colsb[c]) + ", a " +
          std::to_string(tiles.rows[a]) + "x" + std::to_string(tiles.colsb[a]) + ", b " +
          std::to_string(tiles.rows[b]) + "x" + std::to_string(tiles.colsb[b]));
  for (int m = 0; m < M; m++) {
    float acc[16];
    uint16_t x[32];
    std::memcpy(acc, tiles.data[c][m], 64), std::memcpy(x, tiles.data[a][m], 64);
    for (int k = 0; k < K; k++) {
      uint16_t y[32];
      std::memcpy(y, tiles.data[b][k], 64);
      for (int n = 0; n < N; n++) {
        acc[n] = fma_ftz(bf16_to_float(x[2 * k]), bf16_to_float(y[2 * n]), daz(acc[n]));
        acc[n] = fma_ftz(bf16_to_float(x[2 * k + 1]), bf16_to_float(y[2 * n + 1]), acc[n]);
      }
    }
    std::memcpy(tiles.data[c][m], acc, 4 * N);
  }
}

}  // namespace eagle_emu

// The kernel's calls, to the functions above (immintrin.h's own are never called).
#define _mm512_setzero_ps eagle_emu::setzero_ps
#define _mm512_set1_ps eagle_emu::set1_ps
#define _mm512_set1_epi32 eagle_emu::set1_epi32
#define _mm512_loadu_si512 eagle_emu::loadu_si512
#define _mm512_loadu_ps eagle_emu::loadu_ps
#define _mm512_load_ps eagle_emu::load_ps
#define _mm512_store_si512 eagle_emu::store_si512
#define _mm512_castsi512_ps eagle_emu::castsi512_ps
#define _mm512_slli_epi32 eagle_emu::slli_epi32
#define _mm512_srai_epi32 eagle_emu::srai_epi32
#define _mm512_and_si512 eagle_emu::and_si512
#define _mm512_mul_ps eagle_emu::mul_ps
#define _mm512_fmadd_ps eagle_emu::fmadd_ps
#define _mm512_cvtepi32_ps eagle_emu::cvtepi32_ps
#define _mm512_cvtepi8_epi16 eagle_emu::cvtepi8_epi16
#define _mm512_cvtepi8_epi32 eagle_emu::cvtepi8_epi32
#define _mm512_cvtneps_pbh eagle_emu::cvtneps_pbh
#define _mm512_cvtne2ps_pbh eagle_emu::cvtne2ps_pbh
#define _mm512_dpbf16_ps eagle_emu::dpbf16_ps
#undef _tile_loadconfig
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig eagle_emu::tile_loadconfig
#define _tile_zero eagle_emu::tile_zero
#define _tile_loadd eagle_emu::tile_loadd
#define _tile_stored eagle_emu::tile_stored
#define _tile_dpbf16ps eagle_emu::tile_dpbf16ps
