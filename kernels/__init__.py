"""kvfleet kernels: paged-KV-cache attention as Triton kernels (CUDA) with torch
reference implementations (CPU, and the oracle in tests)."""
