"""`python -m model.kernels`: build the kernels now and load them (the Docker image runs this at build time, so the
server needs no compiler). Exits 1 where they cannot be used, saying why."""

import logging

from model.kernels import build, loader

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = loader.load()
    variant = loader.variant()
    where = build.build_directory(variant) if variant is not None else "nothing built"
    print(f"CPU decode kernels: {loader.status()} ({variant.name if variant else '-'}: {where})")
    raise SystemExit(0 if ok else 1)
