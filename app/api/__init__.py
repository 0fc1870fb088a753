"""API families, one package each: routes (`router.py`), wire models (`protocol.py`), serving (`serving.py`)."""
