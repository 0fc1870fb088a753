"""`python -m app`: serve a checkpoint over HTTP.

    python -m app [--checkpoint DIR] [--host H] [--port P] [--device D] ...

Every option is also read from a `FOLIO_*` environment variable (flags win). A start-up mistake (a bad flag or
value, an unknown `FOLIO_*` variable, a device this machine lacks, an address that cannot be bound, a checkpoint
that cannot be read) ends the process with one `error:` line and exit code 2, before anything is served.
Then the port opens at once, while the engine is built and warmed up (`BackgroundLifespan`; minutes on a first
start that builds the CPU kernels): meanwhile the generation routes, /health, /health/startup and /health/ready
answer 503 with `Retry-After` and /health/live 200 ("loading"). A model that fails to load then (the engine cannot
be built or warmed up) ends the process with the traceback logged, one `error:` line and exit code 2.
SIGTERM (or Ctrl-C): keep listening but answer new work 503, let in-flight requests finish for up to
`--drain-timeout` seconds, end the rest with a final error event, exit 0 (`DrainingServer`); while loading, exit
at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError
from pydantic_settings import SettingsError
from uvicorn.lifespan.on import LifespanOn

from app.http.connection import protocol_class
from app.http.requestlog import configure_logging
from app.main import create_app
from app.settings import Settings, check_environment, env_name
from model import heap
from model.checkpoint import CheckpointError, load_checkpoint
from model.cli import ArgumentParser
from model.devices import resolve_device

WATCH_DEFAULT_S = 1.0  # `--watch` without a value: how often the checkpoints' config.json are read
FINAL_WRITES_S = 2  # after the drain: how long responses still being written may take before they are cut


def parse_args(argv: list[str] | None) -> dict:
    p = ArgumentParser(prog="python -m app", description="Serve a Folio checkpoint over HTTP.",
                       argument_default=argparse.SUPPRESS)
    for name, f in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = f"{f.description or ''} (env {env_name(name)})"
        if f.annotation is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
        elif name in ("cors_origins", "lora_modules"):
            p.add_argument(flag, nargs="*", help=help_)
        elif name == "checkpoint":
            p.add_argument(flag, action="append", help=help_ + "; give it several times to serve several")
        elif name == "watch":
            p.add_argument(flag, nargs="?", const=WATCH_DEFAULT_S, metavar="SECONDS",
                           help=help_ + f"; --watch alone: every {WATCH_DEFAULT_S:g} s")
        else:
            p.add_argument(flag, help=help_)
    args = vars(p.parse_args(argv))
    if "checkpoint" in args:  # the first is the default model; the others join --models
        first, *more = args["checkpoint"]
        args["checkpoint"] = first
        if more:
            args["models"] = [*more, *(args.get("models") or "").split(",")]
    return args


class BackgroundLifespan(LifespanOn):
    """uvicorn's lifespan, whose startup (app/main.py: load the model, build the engine, warm it up) is not waited
    for: uvicorn opens its port only once the lifespan's startup has ended, and a server that refuses connections
    while it loads never shows the 503 a load balancer and Kubernetes' startup probe expect. A startup that fails
    sets `should_exit`, which `DrainingServer` acts on."""

    starting: asyncio.Future | None = None
    abandoned = False

    async def startup(self) -> None:
        self.starting = asyncio.ensure_future(super().startup())

    async def shutdown(self) -> None:
        if self.starting is not None and not self.starting.done():  # a signal while loading: the load is abandoned
            self.abandoned = True
            self.logger.info("stopped while the model was loading")
            self.starting.cancel()
            return
        await super().shutdown()

    async def send(self, message: Any) -> None:  # noqa: ANN401 (uvicorn's ASGI message)
        if self.abandoned and message["type"] == "lifespan.startup.failed":
            message = {**message, "message": ""}  # the startup cancelled at exit: not a failure to log
        await super().send(message)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain. On the first SIGTERM or SIGINT the listener stays open: requests to the
    generation routes and /tokenize get 503 with `Retry-After` (and `Connection: close`), /health 503 "draining",
    while the requests already admitted run on. As soon as none is left (`Lifecycle.in_flight`: their
    responses have ended), or after `drain_timeout` seconds (then the engine stops, which ends each stream still
    running with a final error event), uvicorn's shutdown follows: the listener closes, responses being written
    are finished (for up to `FINAL_WRITES_S`), the process exits. A second signal skips what is left of the
    drain. A load balancer in front sees 503s (nginx's `proxy_next_upstream http_503` retries elsewhere) and a
    failing readiness probe, never a refused connection while streams finish."""

    def __init__(self, config: uvicorn.Config, app, drain_timeout: float) -> None:  # noqa: ANN001
        super().__init__(config)
        self.folio_app = app
        self.drain_timeout = drain_timeout
        self.drain_started: float | None = None

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001
        models = self.folio_app.state.models
        if not models.ready or self.drain_started is not None:  # still loading, or the second signal
            super().handle_exit(sig, frame)
            return
        models.set_draining()
        self.drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop calls this every 0.1 s; True ends the loop and starts the shutdown."""
        if self.lifespan.should_exit:  # the model could not be loaded (`BackgroundLifespan`)
            self.should_exit = True
        if self.drain_started is not None and not self.should_exit:
            if self.folio_app.state.models.lifecycle.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() - self.drain_started >= self.drain_timeout:
                await asyncio.to_thread(self.folio_app.state.models.registry.stop)
                self.should_exit = True
        return await super().on_tick(counter)


def settings_error(e: ValidationError) -> str:
    """The first problem as one line naming the flag and its variable, and the value unless it is the key."""
    first = e.errors()[0]
    if not first["loc"]:  # a check across fields: its message names them
        return first["msg"].removeprefix("Value error, ")
    field = str(first["loc"][0])
    shown = field != "api_key" and first["type"] != "value_error"  # Folio's own checks quote what they need
    got = f", got {str(first['input'])[:80]!r}" if shown else ""
    return f"--{field.replace('_', '-')} ({env_name(field)}): {first['msg'].removeprefix('Value error, ')}{got}"


def check_listen(host: str, port: int) -> None:
    """Bind the address once and let it go, before the model loads: a port in use or a host that does not resolve
    is then one line at once, not a uvicorn log after the load (uvicorn binds it again to serve)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
            s.bind(address)
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None


def startup_settings(argv: list[str] | None) -> Settings:
    """Flags and FOLIO_* variables checked against each other, this machine's devices and the address to listen
    on; a ValueError whose message is the one line to print otherwise."""
    args = parse_args(argv)  # first: --help works whatever the environment holds
    check_environment(os.environ)
    try:
        settings = Settings(**args)
    except ValidationError as e:
        raise ValueError(settings_error(e)) from None
    except SettingsError as e:  # a variable the settings could not even parse
        raise ValueError(str(e)) from None
    resolve_device(settings.device)
    check_listen(settings.host, settings.port)
    return settings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = startup_settings(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    heap.pauses.watch()  # /metrics shows the garbage collector's pauses, frozen heap or not (model/heap.py)
    try:
        # the default checkpoint is loaded here (a broken one: one line, exit 2); its engine is built in the
        # lifespan, while the port is open (`BackgroundLifespan`), the other models' on first use
        app = create_app(settings, checkpoint=load_checkpoint(settings.checkpoint),
                         freeze_heap=settings.gc_freeze)
    except (CheckpointError, OSError, RuntimeError, ValueError) as e:  # OSError: a file it may not read
        print(f"error: cannot serve {settings.checkpoint}: {e}", file=sys.stderr)
        return 2
    server = make_server(settings, app)
    # once shut down, uvicorn re-raises the signal it caught under the handlers it found: no-op ones make a
    # drained shutdown return 0 below instead of dying of that signal (exit status -15 for SIGTERM)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    if app.state.startup_error is not None:
        print(f"error: cannot serve {settings.checkpoint}: {app.state.startup_error}", file=sys.stderr)
        return 2
    return 0 if server.started else 1


def make_server(settings: Settings, app: FastAPI) -> DrainingServer:
    """The uvicorn server for `app`, configured by `settings`, its lifespan started in the background."""
    # httptools and uvloop (dependencies), not h11 and asyncio's loop: the event loop's cost per request and per
    # streamed event is what HTTP adds to the engine, and what a burst of refusals costs (bench/reliability/);
    # the httptools protocol with deadlines and size bounds on each request's head and body (app/http/connection.py)
    closed = app.state.metrics.connections_closed
    # log_config=None: uvicorn's lines go through the handler configure_logging set (the log format, request IDs);
    # access_log=False: the access log is Folio's own (app/http/requestlog.py), with tokens and timings
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            log_config=None, timeout_graceful_shutdown=FINAL_WRITES_S, access_log=False,
                            limit_concurrency=settings.max_connections,
                            # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local process (or a
                            # client through a proxy that passes the header on) could write the client's address
                            proxy_headers=settings.forwarded_allow_ips is not None,
                            forwarded_allow_ips=settings.forwarded_allow_ips,
                            http=protocol_class(settings, lambda reason: closed.labels(reason).inc()),
                            loop="uvloop" if sys.platform != "win32" else "asyncio")
    config.load()
    config.lifespan_class = BackgroundLifespan
    return DrainingServer(config, app, settings.drain_timeout)


if __name__ == "__main__":
    sys.exit(main())
