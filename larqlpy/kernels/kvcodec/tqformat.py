"""TurboQuant's storage format in plain Python: the widths it offers, the head dims it takes and the
bytes a row costs. Option checks and accounting read these without loading numba or torch."""

from __future__ import annotations

WIDTHS = (2, 3, 4, 5, 6, 8)  # bits per coordinate the codec engines offer (k_bits / v_bits)
NORM_BYTES = 4  # one f32 norm per row


def code_bytes(d: int, bits: int) -> int:
    return d * bits // 8


def row_bytes(d: int, bits: int) -> int:
    """Bytes of one encoded head row: its norm and its packed indices."""
    return NORM_BYTES + code_bytes(d, bits)


def check_bits(bits: int) -> None:
    if bits not in WIDTHS:
        raise ValueError(f"bits must be one of {', '.join(map(str, WIDTHS))}, got {bits}")


def check_dim(d: int) -> None:
    if d < 8 or d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two >= 8 (the Walsh-Hadamard rotation needs one)")
