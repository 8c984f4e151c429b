"""The decode loop: one `Sequence` type drives every generation (sampling, stop ids and stop strings,
the detokenizer, timing); `stream.generate_step` runs one, `scheduler.Scheduler` batches many."""
