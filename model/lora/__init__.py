"""LoRA adapters: `adapter.py` the format (PEFT's, read and written), training modules and merging; `batched.py`
serving several adapters over one base in one batch."""
