"""How long a memory operation takes (LLM-Mesh Figure 8, an A100): a KV cache resize is
proportional to the bytes it changes, 32 -> 64 GB in 1.9 s and 32 -> 16 GB in 0.3 s. The
simulated engine charges it, and the cluster predicts an instance's cold start with it."""
GIB = 2**30
RESIZE_UP_S_PER_GIB = 1.9 / 32  # Figure 8: +32 GB in 1.9 s
RESIZE_DOWN_S_PER_GIB = 0.3 / 16  # Figure 8: -16 GB in 0.3 s

# Node memory (LLM-Mesh 8.1 testbed). GPU: the A100's 80 GB. CPU: 256 GB of DDR5 for
# instances (8 channels x 32 GB DIMMs, the usual 8 GB per core of a 32-core cloud node);
# the host copy of every model (8.1: all models cached in CPU memory) is not counted in it.
DEFAULT_GPU_MEMORY_BYTES = 80 * GIB
DEFAULT_CPU_MEMORY_BYTES = 256 * GIB
