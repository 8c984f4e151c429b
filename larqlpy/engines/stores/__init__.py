"""How each engine keeps its rows (torch): the layer store protocol (base.py) and a sequence's state
(state.py), row storage and the stores kept in named row sets (rows.py, rowstore.py), the K/V codec
pair, the key calibration, mmap reads (numpy only), one store per engine."""
