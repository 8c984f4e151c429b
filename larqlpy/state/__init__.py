"""Where a sequence's attention state comes from and where it goes: the one protocol
(sources.py: `Held`, `StateSource`, `Given`, `align`), a state file as a source and as where a run
saves (saved.py), a server's kept states (prefix_cache.py), the branches of one prompt
(branches.py), and the file format itself (format.py, store.py)."""
