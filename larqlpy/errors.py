"""The one error type the CLI turns into a single line and exit code 2."""


class LarqlError(Exception):
    """Bad input at a boundary (CLI argument, model directory, GGUF file, engine spec)."""

    exit_code = 2
