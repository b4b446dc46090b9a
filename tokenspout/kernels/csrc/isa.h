/* The x86 intrinsics every kernel source includes: the CPU's own (immintrin.h), or, in the emulated builds
 * (-DTS_SIMDE=1, cpu.load_emulated: tests only), SIMDe's portable versions of the same names, so the AVX-512 level's
 * code compiles for and runs on a CPU with AVX2 only and stays tested there (slowly; results as on the real ISA,
 * since every emulated intrinsic computes what the instruction does). */
#ifndef TS_ISA_H
#define TS_ISA_H

#ifndef TS_SIMDE
#define TS_SIMDE 0
#endif

#if TS_SIMDE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
/* (not in SIMDe 0.8.2: vpermilps with one source is vshufps with the same vector twice) */
#define _mm512_permute_ps(a, imm) _mm512_shuffle_ps((a), (a), (imm))
#else
#include <immintrin.h>
#endif

#endif
