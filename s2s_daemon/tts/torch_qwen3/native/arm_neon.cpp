// The `neon` path: arm.inc with Armv8.0's Advanced SIMD alone, which every aarch64 CPU has: the
// integer formats on widening multiplies. Compiled for the
// baseline (setup.py gives this unit no -march), so it holds no newer instruction than the portable
// path's (scripts/arm64_check.sh looks for SDOT and SMMLA in its object).

#if defined(__aarch64__)

#include <arm_neon.h>

#include "kernels.h"

#define S2S_DOTPROD 0
#define S2S_I8MM 0

namespace {
#include "arm.inc"
}  // namespace

extern "C" const s2s::Ops s2s_ops_neon = {"neon", stream, blocked, widen, snake, stack};

#endif
