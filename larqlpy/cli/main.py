"""`larqlpy` command line: the app and its entry point. Each command group is its own module; typer
and rich live in cli/ only, and so do flag names."""

from __future__ import annotations

import atexit
import gc
import os
import sys

import typer

from larqlpy.cli import batch, batch_merge, bench, chat, model, observe, residency, run, serve, state, warmup
from larqlpy.cli.common import err, error_line
from larqlpy.errors import LarqlError
from larqlpy.kernels.contention import choose_waits

try:  # recent typer vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="LLM inference with pluggable KV engines.")
app.command()(run.run)
app.command()(batch.batch)
app.command("batch-merge")(batch_merge.batch_merge)
app.command()(chat.chat)
app.command()(serve.serve)
app.command()(model.info)
app.command("convert-gguf")(model.convert_gguf)
app.command()(model.calibrate)
app.command()(residency.residency)
app.command("kv-stats")(observe.kv_stats)
app.command()(warmup.warmup)
app.add_typer(bench.bench_app, name="bench")
app.add_typer(state.state_app, name="state")


def main() -> None:
    """Entry point: bad input is one line on stderr and exit 2, never a traceback."""
    try:
        rv = app(standalone_mode=False)
    except LarqlError as e:
        err.print(f"larqlpy: error: {error_line(e)}", markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except NoArgsIsHelpError as e:
        err.print(e.ctx.get_help() if e.ctx else "usage: larqlpy --help", markup=False)
        sys.exit(2)
    except ClickException as e:
        err.print(f"larqlpy: error: {e.format_message()}", markup=False, soft_wrap=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err.print("larqlpy: interrupted", markup=False)
        sys.exit(130)
    except BrokenPipeError:
        sys.stderr.close()  # the reader went away (e.g. `| head`): not an error worth a traceback
        sys.exit(0)
    except OSError as e:
        err.print(f"larqlpy: error: {e}", markup=False, soft_wrap=True)
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)


_exit_code: list[int] = []


def _skip_teardown() -> None:
    """Registered before anything else, so it runs after every other exit handler (Ray's shutdown,
    the tokenizer helper's, ...): flush the output, then leave without the interpreter's teardown --
    freeing torch's, numba's and the weights' objects one by one costs a one-shot process a large part
    of its run after its work is done (docs/benchmarks.md). Every file larqlpy writes is complete and
    renamed into place by then."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, a closed stream
            pass
    os._exit(_exit_code[0] if _exit_code else 1)


def entry() -> None:
    """The console script and `python -m larqlpy.cli.main`: `main`, then a fast exit. The garbage
    collector is off until the command's start-up is over (common.started)."""
    gc.disable()
    atexit.register(_skip_teardown)
    choose_waits()  # before torch or numba starts a thread: sleep, not spin, beside other busy work
    try:
        main()
    except SystemExit as e:
        code = e.code
        _exit_code.append(code if isinstance(code, int) else 0 if code is None else 1)
        raise


if __name__ == "__main__":
    entry()
