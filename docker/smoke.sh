#!/usr/bin/env bash
# Smoke test of the image, where a Docker engine runs:
#
#   docker/smoke.sh              # build the CPU image, run it, check it
#   docker/smoke.sh --gpu        # the CUDA image (TORCH_VARIANT, default cu128) on --gpus all
#   docker/smoke.sh --replicas   # also: 2 replicas behind nginx with docker/compose.yaml
#
# Checks, as tests/deploy/test_nginx.py does without Docker: /health turns healthy (the image's
# HEALTHCHECK), /generate answers, /generate_stream streams several events before its final one, the
# server runs as a non-root user, serves the bundled weights without a volume and the mounted /weights
# with one, and `docker stop` (SIGTERM) drains and exits 0. With --replicas the same requests go through
# nginx and both replicas must have served some. Where no Docker engine is reachable it says so and exits 77
# (the conventional "skipped" status) without building anything.
set -euo pipefail
cd "$(dirname "$0")/.."

GPU=0
REPLICAS=0
for arg in "$@"; do
  case "$arg" in
    --gpu) GPU=1 ;;
    --replicas) REPLICAS=1 ;;
    *) echo "usage: docker/smoke.sh [--gpu] [--replicas]" >&2; exit 2 ;;
  esac
done

if ! command -v docker >/dev/null 2>&1; then
  echo "smoke.sh: skipped: no docker command on this machine; nothing was built." >&2
  exit 77
fi
if ! docker info >/dev/null 2>&1; then
  echo "smoke.sh: skipped: no Docker engine is reachable ('docker info' failed); the image cannot be built" \
       "or run here. The Dockerfile is linted and docker/nginx.conf tested without Docker by tests/deploy." >&2
  exit 77
fi

VARIANT=cpu
RUN_ARGS=()
if [ "$GPU" = 1 ]; then
  VARIANT="${TORCH_VARIANT:-cu128}"
  RUN_ARGS=(--gpus all -e FOLIO_DEVICE=cuda)
fi
IMAGE="folio-smoke:$VARIANT"
export SMOKE_VARIANT="$VARIANT"
CONTAINERS=()
VOLUME_DIR=""
cleanup() {
  for c in "${CONTAINERS[@]}"; do docker rm -f "$c" >/dev/null 2>&1 || true; done
  [ -z "$VOLUME_DIR" ] || rm -rf "$VOLUME_DIR"
  if [ "$REPLICAS" = 1 ]; then
    docker compose -f docker/compose.yaml -p folio-smoke --profile replicas down -v >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

fail() { echo "smoke.sh: FAILED: $*" >&2; exit 1; }

echo "== build $IMAGE"
docker build -f docker/Dockerfile --build-arg "TORCH_VARIANT=$VARIANT" -t "$IMAGE" .

# wait_healthy CONTAINER: until the HEALTHCHECK reports healthy (the image's own /health probe)
wait_healthy() {
  for _ in $(seq 1 120); do
    status="$(docker inspect -f '{{.State.Health.Status}}' "$1")"
    [ "$status" = healthy ] && return 0
    [ "$(docker inspect -f '{{.State.Running}}' "$1")" = true ] || { docker logs "$1" >&2; fail "$1 exited"; }
    sleep 2
  done
  docker logs "$1" >&2
  fail "$1 never became healthy (last status: $status)"
}

# check_api URL [EXPECTED_CHECKPOINT]: /health, /generate, /generate_stream (and /info's checkpoint)
check_api() {
  python3 - "$@" <<'PY'
import json, os, sys, urllib.request

base = sys.argv[1]
want_checkpoint = sys.argv[2] if len(sys.argv) > 2 else None
want_device = "cuda" if os.environ.get("SMOKE_VARIANT", "cpu").startswith("cu") else "cpu"

def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)

with urllib.request.urlopen(base + "/health", timeout=10) as r:
    assert r.status == 200, r.status
params = {"max_new_tokens": 40, "do_sample": True, "temperature": 0.8, "seed": 1}
with post("/generate", {"inputs": "ROMEO:", "parameters": params}) as r:
    text = json.load(r)["generated_text"]
    assert len(text) > 0, text
with post("/generate_stream", {"inputs": "ROMEO:", "parameters": params}) as r:
    assert r.headers["Content-Type"].startswith("text/event-stream"), r.headers["Content-Type"]
    events = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data:")]
    assert len(events) == 40 and events[-1]["generated_text"] == text, (len(events), events[-1])
if want_checkpoint:
    with urllib.request.urlopen(base + "/info", timeout=10) as r:
        info = json.load(r)
        assert info["checkpoint"] == want_checkpoint, (info["checkpoint"], want_checkpoint)
        assert info["device"].startswith(want_device), (info["device"], want_device)
print(f"ok: {base}: health, generate, generate_stream ({len(events)} events): {text[:40]!r}")
PY
}

# start NAME [docker run args...]: run the image detached on a random local port, wait until healthy; sets URL
start() {
  local name="$1"; shift
  CONTAINERS+=("$name")
  docker run -d --name "$name" -p 127.0.0.1::8000 "${RUN_ARGS[@]}" "$@" "$IMAGE" >/dev/null
  wait_healthy "$name"
  URL="http://$(docker port "$name" 8000/tcp | head -n1)"
}

echo "== the bundled weights, no volume"
start "folio-smoke-$$-a"
check_api "$URL" /app/weights/shakespeare-char
uid="$(docker exec "folio-smoke-$$-a" id -u)"
[ "$uid" != 0 ] || fail "the server runs as root"
echo "ok: runs as uid $uid"

echo "== a checkpoint mounted at /weights"
# a copy made readable for the container's uid 10001 (checkpoints are written 0600)
VOLUME_DIR="$(mktemp -d)"
cp weights/shakespeare-char/config.json weights/shakespeare-char/model.safetensors "$VOLUME_DIR/"
chmod -R a+rX "$VOLUME_DIR"
start "folio-smoke-$$-b" -v "$VOLUME_DIR:/weights:ro"
check_api "$URL" /weights

echo "== SIGTERM drains and exits 0"
docker stop -t 40 "folio-smoke-$$-b" >/dev/null
code="$(docker inspect -f '{{.State.ExitCode}}' "folio-smoke-$$-b")"
[ "$code" = 0 ] || { docker logs "folio-smoke-$$-b" >&2; fail "exit code $code after docker stop"; }
echo "ok: exit code 0 after SIGTERM"

if [ "$REPLICAS" = 1 ]; then
  echo "== 2 replicas behind nginx (docker/compose.yaml, profile replicas)"
  export FOLIO_REPLICAS=2 FOLIO_PROXY_PORT="${FOLIO_PROXY_PORT:-18080}"
  docker compose -f docker/compose.yaml -p folio-smoke --profile replicas up -d --build --wait nginx
  for _ in 1 2 3 4; do check_api "http://127.0.0.1:$FOLIO_PROXY_PORT"; done
  for c in $(docker compose -f docker/compose.yaml -p folio-smoke ps -q replica); do
    served="$(docker exec "$c" python -c "import urllib.request as u; print(sum(float(l.split()[-1]) for l in u.urlopen('http://127.0.0.1:8000/metrics').read().decode().splitlines() if l.startswith('folio_requests_total') and 'generate' in l))")"
    [ "${served%.*}" -gt 0 ] || fail "replica $c served no request through nginx"
    echo "ok: replica ${c:0:12} served $served generation requests"
  done
fi

echo "smoke.sh: all checks passed ($IMAGE)"
