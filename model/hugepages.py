"""Large CPU tensors on transparent huge pages (Linux): the KV cache is read in a few KB at a time at addresses
spread over hundreds of MB (each (row, head)'s keys are their own block), so with 4 KiB pages nearly every read
of a decode step's attention missed the TLB. Advised before its first touch, the kernel backs such a tensor with
2 MiB pages where transparent huge pages are enabled ("always" or "madvise" in
/sys/kernel/mm/transparent_hugepage/enabled); elsewhere it is an ordinary tensor."""

from __future__ import annotations

import ctypes
import sys

import torch

MADV_HUGEPAGE = 14  # <sys/mman.h>
HUGE_PAGE = 2 << 20

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on CPU, its whole 2 MiB pages advised MADV_HUGEPAGE before they are
    first written (a tensor smaller than a page, or a platform without madvise, is left as it is)."""
    t = torch.empty(shape, dtype=dtype)
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if _libc is not None and last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE)  # advice: no error
    return t.zero_()
