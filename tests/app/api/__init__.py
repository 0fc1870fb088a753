"""The HTTP API in process, against the real app: `create_app(settings)` with its lifespan run by Starlette's
TestClient, a real checkpoint loaded from disk, the real engine thread. Every assertion is on status and body.

Disconnects are driven at the ASGI level (a `receive` that reports `http.disconnect` when the test says so),
which is what uvicorn does when a socket closes; `tests/app/test_server.py` repeats the non-streaming case over TCP.
"""
