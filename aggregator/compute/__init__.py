"""Where the math runs (CUDA or CPU) and the numerical kernels the jobs share."""
