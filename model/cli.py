"""Start-up plumbing shared by Folio's commands (`python -m app`, `python -m model.train`, ...): a mistake on the
command line, in the environment or about the machine ends as one `error:` line on stderr and exit code 2,
never a usage dump or a traceback (`--device` names are checked by `model.devices.resolve_device`); and the
checkpoint they read by default, the bundled model, wherever they run.

Each command names itself in its usage and errors by how it was started: `python -m model.train` when run as a
module, `folio train` when the `folio` command (app/cli.py) runs the same `main` inside `program("folio train")`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NoReturn

MODULE_PROG = "python -m "  # how the modules name themselves (`prog=`) when run on their own
# the model bundled with Folio, found beside its packages: what every command reads without --checkpoint (`folio
# serve` too: app/settings.py), from whatever directory it runs in
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "weights" / "shakespeare-char"
_program: ContextVar[str | None] = ContextVar("folio_program", default=None)


@contextmanager
def program(name: str) -> Iterator[None]:
    """Within the block, a command's parser is named `name` (e.g. `folio train`) instead of its `python -m` name."""
    token = _program.set(name)
    try:
        yield
    finally:
        _program.reset(token)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line (`error: <what> (see <prog> --help)`) and exit code 2, and which
    takes the name `program` gives (subcommands' parsers, named after their parent, follow it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        name = _program.get()
        if name is not None and self.prog.startswith(MODULE_PROG):
            self.prog = name

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_checkpoint_option(parser: argparse.ArgumentParser) -> None:
    """`--checkpoint DIR`, the bundled model (DEFAULT_CHECKPOINT) when not given: the one default of the commands
    that read a checkpoint."""
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                        help="checkpoint directory (default: the bundled model, weights/shakespeare-char)")


def check_threads(threads: int) -> int:
    """`--threads` between 0 (torch's default) and the machine's cores: far more threads than cores only slows
    torch down, and tens of thousands crash it (OpenMP cannot create them)."""
    cores = os.cpu_count() or 1
    if not 0 <= threads <= cores:
        raise ValueError(f"must be between 0 (all cores) and this machine's {cores} cores, got {threads}")
    return threads
