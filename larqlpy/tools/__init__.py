"""Measurement tools over a loaded model: observe, ladder, needle, quality, residency, monitor."""
