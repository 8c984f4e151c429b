"""Weight files: the checkpoint reader, the loader, the packed-weight cache, native codes and the key
calibration file."""
