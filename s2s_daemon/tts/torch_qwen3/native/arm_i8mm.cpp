// The `i8mm` path: arm.inc with the int8 matrix multiply (FEAT_I8MM's SMMLA: a 2x8 by 8x2 block of
// int8 into four int32 sums) beside SDOT: the integer formats' pairs of weight rows against pairs of
// input rows. setup.py compiles this unit alone with
// -march=armv8.2-a+dotprod+i8mm; the CPU is checked (HWCAP2_I8MM) before it runs.

#if defined(__aarch64__)

#if !defined(__ARM_FEATURE_DOTPROD) || !defined(__ARM_FEATURE_MATMUL_INT8)
#error "arm_i8mm.cpp is compiled with -march=armv8.2-a+dotprod+i8mm (setup.py's ISA_FLAGS)"
#endif

#include <arm_neon.h>

#include "kernels.h"

#define S2S_DOTPROD 1
#define S2S_I8MM 1

namespace {
#include "arm.inc"
}  // namespace

extern "C" const s2s::Ops s2s_ops_i8mm = {"i8mm", stream, blocked, widen, snake, stack};

#endif
