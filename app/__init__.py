"""Folio's HTTP service and the inference engine behind it."""
