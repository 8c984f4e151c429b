"""The KV codec's kernels: TurboQuant rows coded and decoded (turboquant.py, its torch twin, the
codebooks and their Lloyd-Max design, widths in tqformat.py), the row codecs the stores hold
(rowcodec.py), a decode step's rows written as codes (tq_step.py), and decode attention on codes
(tq_attend.py, over tq_parts.py)."""
