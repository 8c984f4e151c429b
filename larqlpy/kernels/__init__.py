"""Kernels, by family: weights/ (packed and native weight matrices and their products), kvcodec/
(TurboQuant codes: coding rows and attending on them), attention/ (decode attention over exact
rows); and the platform they share, flat here: what the CPU has (cpu.py), threads and contention,
MKL's reproducible mode (blas.py), numba's cache (jitcache.py) and the scalar helpers the kernels
inline (scalars.py)."""

from larqlpy.kernels.blas import reproducible_gemm

reproducible_gemm()  # before torch's first product: MKL reads it once
