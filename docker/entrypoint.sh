#!/bin/sh
# The image's entrypoint. With no arguments, or only flags: serve, `python -m app [FLAGS]`. Anything else runs
# as a command (`docker run folio python -m model.train ...`, `torchrun ...`).
#
# The checkpoint served: FOLIO_CHECKPOINT if set; else the volume at FOLIO_WEIGHTS_VOLUME (default /weights)
# if it holds a checkpoint (config.json); else the bundled weights/shakespeare-char (the server's default).
# `exec`, so that the server replaces this shell and receives SIGTERM directly.
set -eu

volume="${FOLIO_WEIGHTS_VOLUME:-/weights}"
if [ -z "${FOLIO_CHECKPOINT:-}" ] && [ -f "$volume/config.json" ]; then
    if [ ! -r "$volume/config.json" ]; then
        echo "error: the checkpoint in $volume is not readable by uid $(id -u): make it readable" \
             "(chmod -R a+rX DIR on the host) or run the container with --user <its owner's uid>" >&2
        exit 2
    fi
    export FOLIO_CHECKPOINT="$volume"
fi

case "${1:-}" in
    "" | -*) exec python -m app "$@" ;;
    *) exec "$@" ;;
esac
