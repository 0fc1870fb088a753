"""HTTP plumbing shared by every route: connection bounds, limits, admission, auth, request log, metrics, errors."""
