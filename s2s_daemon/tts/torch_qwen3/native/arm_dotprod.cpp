// The `dotprod` path: arm.inc with Armv8.2's dot product (SDOT: four int8 products into each int32
// lane). setup.py compiles this unit alone with -march=armv8.2-a+dotprod; the CPU is checked
// (HWCAP_ASIMDDP) before it runs.

#if defined(__aarch64__)

#if !defined(__ARM_FEATURE_DOTPROD)
#error "arm_dotprod.cpp is compiled with -march=armv8.2-a+dotprod (setup.py's ISA_FLAGS)"
#endif

#include <arm_neon.h>

#include "kernels.h"

#define S2S_DOTPROD 1
#define S2S_I8MM 0

namespace {
#include "arm.inc"
}  // namespace

extern "C" const s2s::Ops s2s_ops_dotprod = {"dotprod", stream, blocked, widen, snake, stack};

#endif
