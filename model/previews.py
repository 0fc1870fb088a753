"""What an error message shows of a value a client sent: `preview`, a repr cut short whatever the value's size
(every layer's errors use it; model/sampling_params.py's `ValidationError` among them)."""

from __future__ import annotations

import reprlib

PREVIEW_CHARS = 80
# a bounded repr: the ends of a long string or number, the first items of a container
_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = PREVIEW_CHARS


def preview(value: object) -> str:
    """`repr(value)` cut short for an error message: at most about PREVIEW_CHARS characters, with the value's size
    when it was cut, whatever its size (a 5 MB string or a million-item list costs no more than a short one).
    Like repr, it escapes what JSON could not carry as is (a lone surrogate)."""
    shown = _REPR.repr(value)
    if len(shown) > PREVIEW_CHARS:
        shown = shown[: PREVIEW_CHARS - 3] + "..."
    if isinstance(value, str) and (len(value) > PREVIEW_CHARS or shown != repr(value)):
        shown += f" ({len(value)} characters)"
    elif isinstance(value, list | tuple | dict) and len(value) > 4:
        shown += f" ({len(value)} items)"
    elif isinstance(value, int) and "..." in shown:
        shown += f" ({len(str(abs(value)))} digits)"
    return shown
