"""bench/gpu.py's pieces that run anywhere: where a GPU's results go, and reading the two trainers' logs (the run
itself needs a GPU: docs/benchmarks.md, On a GPU)."""

from __future__ import annotations

import pytest

from bench.gpu import read_evals, slug, summarize

# the two trainers' own lines: nanoGPT's train.py prints plain lines, Folio's trainer after a tqdm bar's \r
NANOGPT_LOG = """iter 1: loss 4.1518, time 605.28ms, mfu -100.00%
step 2: train loss 3.8188, val loss 3.8368
saving checkpoint to /tmp/nanogpt-out
step 4: train loss 3.5031, val loss 3.5008
"""
FOLIO_LOG = (" 50%|#####     | 2/4 [00:01<00:01,  1.43step/s]\r                     step 2: train loss 4.3642, val "
             "loss 4.4018\n 75%|#######5  | 3/4\rstep 4: train loss 3.6012, val loss 3.7408\n")


def test_results_go_to_a_folder_named_after_the_gpu() -> None:
    assert slug("NVIDIA H200") == "h200"
    assert slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert slug("") == "gpu"


def test_both_trainers_logs_give_their_evaluations_and_figures() -> None:
    assert read_evals(NANOGPT_LOG) == [(2, 3.8188, 3.8368), (4, 3.5031, 3.5008)]
    assert read_evals(FOLIO_LOG) == [(2, 4.3642, 4.4018), (4, 3.6012, 3.7408)]
    run = summarize(read_evals(FOLIO_LOG), seconds=2.0, tokens=1000, flops_per_token=1e6, peak=1e9)
    assert (run["val_loss_last"], run["val_loss_best"]) == (3.7408, 3.7408)
    assert run["tokens_per_s_overall"] == 500 and run["mfu_overall"] == pytest.approx(0.5)
    assert summarize([], 1.0, 1, 1.0, 1.0)["val_loss_last"] is None
