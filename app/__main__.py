"""`python -m app`: serve a checkpoint over HTTP.

    python -m app [--checkpoint DIR] [--host H] [--port P] [--device D] ...

Every option is also read from a `FOLIO_*` environment variable (flags win). A checkpoint or device that
cannot be used ends the process with one clear line and exit code 2, before anything is served.
SIGTERM (or Ctrl-C): stop admitting (503), let in-flight requests finish for up to `--drain-timeout`
seconds, end the rest with a final error event, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import uvicorn
from pydantic import ValidationError as SettingsError

from app.main import build_engine, create_app
from app.settings import Settings
from model.checkpoint import CheckpointError, load_checkpoint


def parse_args(argv: list[str] | None) -> dict:
    p = argparse.ArgumentParser(prog="python -m app", description="Serve a Folio checkpoint over HTTP.",
                                argument_default=argparse.SUPPRESS)
    for name, f in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = f"{f.description or ''} (env FOLIO_{name.upper()})"
        if f.annotation is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
        elif name == "cors_origins":
            p.add_argument(flag, nargs="*", help=help_)
        else:
            p.add_argument(flag, help=help_)
    return vars(p.parse_args(argv))


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain: on the first signal new requests get 503; after `drain_timeout`
    the engine stops, which ends any stream still running with a final error event."""

    def __init__(self, config: uvicorn.Config, app, drain_timeout: float) -> None:  # noqa: ANN001
        super().__init__(config)
        self.folio_app = app
        self.drain_timeout = drain_timeout
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001
        service = getattr(self.folio_app.state, "service", None)
        if service is not None and self._timer is None:
            service.draining = True
            self._timer = threading.Timer(self.drain_timeout, service.engine.stop)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = Settings(**parse_args(argv))
    except SettingsError as e:
        first = e.errors()[0]
        print(f"error: --{'-'.join(str(x) for x in first['loc'])}: {first['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        checkpoint = load_checkpoint(settings.checkpoint)
        engine = build_engine(settings, checkpoint)
    except (CheckpointError, RuntimeError, ValueError) as e:
        print(f"error: cannot serve {settings.checkpoint}: {e}", file=sys.stderr)
        return 2
    app = create_app(settings, checkpoint=checkpoint, engine=engine)
    # httptools and uvloop (dependencies), not h11 and asyncio's loop: the event loop's cost per request and per
    # streamed event is what HTTP adds to the engine, and what a burst of refusals costs (bench/reliability.py)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.drain_timeout) + 2, access_log=False,
                            http="httptools", loop="uvloop" if sys.platform != "win32" else "asyncio")
    server = DrainingServer(config, app, settings.drain_timeout)
    # once shut down, uvicorn re-raises the signal it caught under the handlers it found: no-op ones make a
    # drained shutdown return 0 below instead of dying of that signal (exit status -15 for SIGTERM)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
