"""Weight matrices on the CPU: packed formats (qweight.py, packing.py, dequant.py), a GGUF's blocks
as codes (gguf_blocks.py, gguf_lowbit.py; written into the tiled layout by tiled_put.py), the integer
dot products and their intrinsics (qdot.py, simd.py, codebytes.py), the measured choices and prefetch
distance (choice.py, prefetch.py), and matvec.py, the one place the model meets them."""
