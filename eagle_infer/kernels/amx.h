// AMX set-up shared by the kernels that multiply on the tiles (bf16_linear.cpp's Linears,
// avx2_attention.cpp's scores): whether this process may use them, and ldtilecfg's operand.
// (kernels/avx2_linear.build folds the hash of every header here into the build flags.)
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace eagle {

// ldtilecfg's 64-byte operand, palette 1: each of the 16 tiles' rows and bytes a row (0: unused).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this CPU has AMX-BF16 (and the AVX-512 the kernels use beside it) and Linux lets this
// process use the tiles (asked for once a library: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA,
// process-wide).
inline bool amx_usable() {
#if defined(EAGLE_EMULATED_AMX)  // tests/avx512_emulation.h: the tiles emulated in C++
  return true;
#endif
  static const bool usable = [] {
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return false;
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return usable;
}

}  // namespace eagle
