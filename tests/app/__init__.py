"""Tests of the HTTP app: in process through its ASGI app, and against real `python -m app` processes."""
