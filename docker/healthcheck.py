"""The container's HEALTHCHECK: exit 0 if GET /health on this container's server answers 200, else 1.

Standard library only (no curl in the image). The port is FOLIO_PORT (default 8000)."""

import os
import sys
import urllib.request

url = f"http://127.0.0.1:{os.environ.get('FOLIO_PORT', '8000')}/health"
try:
    with urllib.request.urlopen(url, timeout=float(os.environ.get("FOLIO_HEALTH_TIMEOUT", "4"))) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception as e:  # refused, timed out, 503 (loading or draining): all unhealthy
    print(f"unhealthy: {url}: {e}", file=sys.stderr)
    sys.exit(1)
