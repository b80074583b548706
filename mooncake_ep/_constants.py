"""Constants shared by the Python layers and, as ``-D EP_*`` macros, by the kernels.

Every number that the reference, the validation and the CUDA sources must agree on lives here.
"""

# FP8 (e4m3fn) dispatch: one fp32 scale per token per FP8_BLOCK channels.
FP8_BLOCK = 128
# Largest finite e4m3fn value; scale = amax / FP8_E4M3_MAX maps a block onto the full range.
FP8_E4M3_MAX = 448.0
# Floor of the per-block amax, so an all-zero block gets a finite, non-zero scale (DeepEP's value).
FP8_AMAX_FLOOR = 1e-4
# UE8M0 scales are packed four exponent bytes to an int32 (the layout recent FP8 GEMMs read).
UE8M0_PER_INT32 = 4

# hidden must be a multiple of this: one fp8 scale block, and 16-byte vector access of bf16 rows.
HIDDEN_ALIGNMENT = FP8_BLOCK

# Limits of the kernels (checked in Python before any launch).
MAX_TOPK = 16
MAX_EXPERTS = 1024
MAX_RANKS = 64
# topk_idx entry meaning "no expert" (DeepEP's convention).
NO_EXPERT = -1

# Bytes of the workspace alignment; every region starts on this boundary (16-byte vectors, and
# the cache line so that flags of different regions never share one).
WORKSPACE_ALIGNMENT = 128

# Timeout value meaning "wait forever".
TIMEOUT_FOREVER = -1
# cudaStreamPerThread: the per-thread default stream, another stream in each thread that names it.
PER_THREAD_DEFAULT_STREAM = 2

# Longest finite timeout: the kernels take it in nanoseconds, as an int64 (~292 years).
MAX_TIMEOUT_US = (2**63 - 1) // 1000

# The one environment variable the library reads: where compiled kernels are cached.
CACHE_DIR_ENV = "MOONCAKE_EP_CACHE_DIR"
