"""Measurement tools over a loaded model: calibrate, observe, ladder, quality, residency, monitor."""
