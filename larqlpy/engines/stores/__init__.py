"""How each engine keeps its rows (torch): the layer store protocol and engine state (base.py), row
storage, the K/V codec pair, the key calibration, mmap reads (numpy only), one store per engine."""
