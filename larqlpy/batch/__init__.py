"""Batch runs, one JSON request per line and one record per line: the lines parsed, run
continuously batched and read back (lines.py), in this process or worker processes (local.py), or
on Ray actors (ray.py)."""
