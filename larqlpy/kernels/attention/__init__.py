"""Decode attention over exact rows on the CPU: any number of sequences in one call (decode.py),
one chunk of rows a work item (chunk.py), and the 16-row dot products in LLVM IR (rowdots.py)."""
