"""Lines that several threads and processes print at once, each kept whole.

`print(text, flush=True)` writes the text and its newline in two calls; with unbuffered output
(`python -u`, PYTHONUNBUFFERED, as under torchrun) each is its own write to the shared pipe, so
two ranks' watchdog lines printed at once come out as "line 1line 2\\n\\n". `print_line` takes
print's arguments and writes the line with its newline in one call, flushed: a line that fits
the pipe's atomic write size (4 KiB on Linux) reaches the reader whole.

    print_line(f" watchdog: rank {rank}: ...", flush=True)
"""

from __future__ import annotations

import sys


def print_line(*values, sep: str | None = " ", end: str | None = "\n", file=None, flush=True):
    """print(), writing the line and its end in one call, always flushed."""
    stream = sys.stdout if file is None else file
    sep = " " if sep is None else sep
    stream.write(sep.join(map(str, values)) + ("\n" if end is None else end))
    stream.flush()
