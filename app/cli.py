"""`folio`: one command for everything Folio does, as `vllm serve` or `text-generation-launcher` are for theirs.

    folio serve --checkpoint weights/my-model        # python -m app
    folio train --preset shakespeare-char-cpu ...    # python -m model.train
    folio sample | convert | eval | inspect ...      # python -m model.generate, ...

Each subcommand is a module's own `main` with the rest of the command line: the same options, checks and exit
codes as `python -m <module>` (which keeps working), named `folio <command>` in its usage and errors
(`model.cli.program`). The subcommands' modules are imported only when run: `folio --help` starts at once.

Exit codes: 0 done; 2 a usage or start-up mistake (one `error:` line on stderr); 1 a failure while running (an
uncaught error, with its traceback, or a closed output pipe: `folio sample | head`); 130 interrupted (Ctrl-C).
A server's Ctrl-C or SIGTERM is its drain, which ends with 0 (`app.__main__`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from model.cli import ArgumentParser, program

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command ended by Ctrl-C
EXIT_FAILURE = 1


@dataclass(frozen=True)
class Command:
    module: str  # the module whose `main(argv)` runs it, also runnable as `python -m <module>`
    summary: str  # one line for `folio --help`


COMMANDS = {
    "serve": Command("app.__main__", "serve a checkpoint over HTTP: TGI's and OpenAI's APIs, metrics, a playground"),
    "train": Command("model.train.__main__",
                     "train a GPT on a text file and write a checkpoint (torchrun for several GPUs)"),
    "sample": Command("model.generate", "continue a prompt from a checkpoint, offline, streaming to stdout"),
    "convert": Command("model.convert", "turn Hugging Face or nanoGPT GPT-2 weights into a Folio checkpoint"),
    "eval": Command("model.eval", "score a text file: perplexity and bits per character"),
    "inspect": Command("model.inspection", "draw a text's attention maps and logit lens as PNG files"),
    "merge": Command("model.merge", "fold a LoRA adapter (PEFT's format) into its base: a full Folio checkpoint"),
}


def _version() -> str:
    try:
        return version("folio")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "(not installed)"


def build_parser() -> ArgumentParser:
    """The top level, for `folio --help` and its usage errors; a command's own options are its module's."""
    width = max(map(len, COMMANDS)) + 2
    listing = "\n".join(f"  {name:<{width}}{c.summary}" for name, c in COMMANDS.items())
    p = ArgumentParser(
        prog="folio",
        usage="folio <command> [options]",
        description=f"Train a small GPT on your own text and serve it over HTTP.\n\ncommands:\n{listing}",
        epilog="`folio <command> --help` lists a command's options. Each command is also a module: `python -m app`\n"
        "(serve) and `python -m model.<command>` (the others).\n"
        "exit codes: 0 done, 1 failed, 2 usage or start-up error, 130 interrupted (Ctrl-C).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"folio {_version()}")
    return p


def _command(parser: ArgumentParser, argv: list[str]) -> str:
    """The command `argv` starts with, or a usage error (`--help` and `--version` exit here)."""
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv[:1])
        parser.error(f"a command is needed: {', '.join(COMMANDS)}")
    name = argv[0]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; the commands are {', '.join(COMMANDS)}"
        parser.error(f"unknown command {name!r}{hint}")
    return name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name = _command(build_parser(), argv)
    try:
        with program(f"folio {name}"):
            return importlib.import_module(COMMANDS[name].module).main(argv[1:])
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the ^C was echoed on
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away (`folio sample | head`): nothing more to say, and nowhere to say it;
        # stdout points at /dev/null so that the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
