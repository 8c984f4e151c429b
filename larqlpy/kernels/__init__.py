"""Kernels, by family: weights/ (packed and native weight matrices and their products), kvcodec/
(TurboQuant codes: coding rows and attending on them), attention/ (decode attention over exact
rows); and the platform they share, flat here: what the CPU has (cpu.py), threads and contention,
numba's cache (jitcache.py) and the scalar helpers the kernels
inline (scalars.py)."""
