"""`keep_freed_memory`: a step's freed temporaries are reused, not faulted in from the kernel again. Counted in
page faults (getrusage's minor faults) of a fresh process choosing 32 sampled rows' tokens step after step."""

from __future__ import annotations

import subprocess
import sys

import pytest

STEPS = """
import resource, sys, torch
from model.malloc import keep_freed_memory
from model.sampler import Sampler, SampleRow, new_generator
from model.sampling_params import SamplingParams
if sys.argv[1] == "kept":
    assert keep_freed_memory()
logits = torch.randn(32, 50304)
rows = [SampleRow(SamplingParams(do_sample=True), new_generator(i)) for i in range(32)]
sampler = Sampler(50257)
for _ in range(10):  # the first steps fault their memory in either way
    sampler(logits, rows)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    sampler(logits, rows)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_is_reused_where_the_default_faults_it_in_every_step() -> None:
    """20 steps: glibc's default faulted 122,027-156,421 pages in (the steps' temporaries trimmed off the heap and
    grown back each step), with the memory kept 1 (1,571 once, during the whole suite: a loaded machine's kernel
    may fault a few pages in anyway, hence a ratio)."""
    default, kept = faults("default"), faults("kept")
    assert default > 20 * 1000, default  # the test sees the faults it is about: over 1,000 pages a step
    assert kept < default / 20, (kept, default)
