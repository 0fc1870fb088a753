"""Which prompt chunks go into the next prefill forward: the packing policy, as a pure function."""

from __future__ import annotations

from collections.abc import Sequence

from model.engine.request import Request


def plan_prefill(prefilling: Sequence[Request], budget: int, block_size: int) -> list[tuple[Request, int]]:
    """The requests whose next prompt chunk goes into one forward, with each chunk's length.

    The oldest admitted request always goes, then the others whose chunks are closest to its length (little
    padding), as many as fit in `budget` tokens counted with padding. A prompt longer than that is fed `budget`
    tokens per step, between decode steps, so a long prompt never stalls the running streams for more than one
    chunk. Shorter chunks are right-padded; padding writes cache slots past its row's position, which nothing
    reads before the row's own tokens overwrite them (a query at position p reads slots 0..p) - so a chunk that
    ends at the context's last slot is never padded."""

    def chunk(r: Request) -> int:
        return min(len(r.prompt) - r.prefilled, budget)

    oldest = prefilling[0]
    others = sorted(prefilling[1:], key=lambda r: abs(chunk(r) - chunk(oldest)))
    plan: list[tuple[Request, int]] = []
    for req in [oldest, *others]:
        n = chunk(req)
        width = max([m for _, m in plan] + [n])
        if plan and width * (len(plan) + 1) > budget:
            continue
        if plan and any(r.prefilled + m == block_size and m < width for r, m in [*plan, (req, n)]):
            continue
        plan.append((req, n))
    return plan
