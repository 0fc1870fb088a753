"""Start-up plumbing shared by Folio's commands (`python -m app`, `python -m model.train`): a mistake on the
command line, in the environment or about the machine ends as one `error:` line on stderr and exit code 2,
never a usage dump or a traceback (`--device` names are checked by `model.devices.resolve_device`)."""

from __future__ import annotations

import argparse
import os
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line (`error: <what> (see <prog> --help)`) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def check_threads(threads: int) -> int:
    """`--threads` between 0 (torch's default) and the machine's cores: far more threads than cores only slows
    torch down, and tens of thousands crash it (OpenMP cannot create them)."""
    cores = os.cpu_count() or 1
    if not 0 <= threads <= cores:
        raise ValueError(f"must be between 0 (all cores) and this machine's {cores} cores, got {threads}")
    return threads
