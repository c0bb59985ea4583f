"""det_gemm's SM90 kernel configs by name (``det_gemm_sm90.h``'s
GemmConfig codes), shared by the library's loader and its build."""

# Named kernel instantiations (det_gemm_sm90.h's GemmConfig codes, stable);
# "auto" lets the library's analytic rule choose by shape. Every config gives
# the same bits (device-tested); rlk_jax chooses among them by measurement.
CONFIGS = {"auto": 0, "cooperative_128x256": 1, "pingpong_64x128": 2,
           "pingpong_64x32": 3, "pingpong_64x64": 4, "swap_pingpong_64x32": 5,
           "cooperative_256x192": 6, "split_256x192_128x256": 7,
           "pingpong_128x128": 8, "cooperative_128x128": 9,
           "cooperative_256x128": 10, "cooperative_128x192": 11,
           "pingpong_64x256": 12, "cooperative_128x256_cluster_1x2": 13,
           "pingpong_64x128_cluster_2x1": 14, "pingpong_64x64_cluster_2x1": 15,
           "pingpong_64x128_cluster_4x2": 16, "pingpong_64x64_cluster_1x2": 17,
           "cooperative_128x320": 18, "pingpong_64x320_cluster_2x1": 19,
           "pingpong_128x96_cluster_2x4": 20,
           "pingpong_128x128_cluster_1x2": 21,
           "swap_cooperative_256x192_cluster_1x2": 22,
           "cooperative_128x96": 23, "pingpong_64x320": 24,
           "cooperative_128x128_cluster_1x1": 25,
           "cooperative_128x320_k32": 26,
           "cooperative_128x192_cluster_1x2": 27,
           "cooperative_128x96_cluster_1x2": 28,
           "cooperative_128x144": 29, "cooperative_128x160": 30,
           "cooperative_128x224": 31, "cooperative_128x80": 32,
           "cooperative_128x144_cluster_1x2": 33,
           "pingpong_192x128_cluster_2x1": 34,
           "pingpong_192x96_cluster_2x1": 35,
           "swap_cooperative_128x192_cluster_1x2": 36}


def kernel_parts(config: str) -> tuple[str, ...]:
  """The one-kernel configs a config runs: the split's two, else itself."""
  if config == "split_256x192_128x256":
    return ("cooperative_256x192", "cooperative_128x256")
  return (config,)
