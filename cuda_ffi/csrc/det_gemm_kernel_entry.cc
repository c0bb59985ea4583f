// A kernel library's entry for one det_gemm kernel object: the launch
// function that object instantiates (compiled with the same -DRLK_TA,
// -DRLK_TB, -DRLK_OUT_F32 and -DRLK_CONFIG), under a name of its own, so
// that one library can hold one kernel or all of them. rlk's loader hands
// the pointer to the main library (rlk_det_gemm_sm90_add_kernel).
// Host code only: it compiles in about a second.
#include "det_gemm_sm90.h"

#define RLK_CAT_(a, b) a##b
#define RLK_CAT(a, b) RLK_CAT_(a, b)
#define RLK_ENTRY                                                          \
  RLK_CAT(RLK_CAT(RLK_CAT(RLK_CAT(RLK_CAT(rlk_det_gemm_sm90_kernel_,       \
                                          RLK_TA),                         \
                                  RLK_TB),                                 \
                          RLK_OUT_F32),                                    \
                  _),                                                      \
          RLK_CONFIG)

extern "C" void* RLK_ENTRY() {
  return reinterpret_cast<void*>(
      &rlk::LaunchGemmConfig<RLK_TA, RLK_TB, RLK_OUT_F32,
                             static_cast<rlk::GemmConfig>(RLK_CONFIG)>);
}
