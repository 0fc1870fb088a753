"""bench/gpu.py's pieces that run anywhere: where a GPU's results go, and reading the two trainers' logs (the run
itself needs a GPU: docs/benchmarks.md, On a GPU)."""

from __future__ import annotations

import pytest

from bench.gpu import TOKENS_PER_ITER, iterations_done, read_evals, slug, summarize

# the two trainers' own lines: nanoGPT's train.py prints plain lines, Folio's trainer after a tqdm bar's \r
NANOGPT_LOG = """iter 1: loss 4.1518, time 605.28ms, mfu -100.00%
step 2: train loss 3.8188, val loss 3.8368
saving checkpoint to /tmp/nanogpt-out
iter 3: loss 3.6, time 10.00ms, mfu 31.00%
step 4: train loss 3.5031, val loss 3.5008
iter 4: loss 3.4, time 12.00ms, mfu 31.00%
"""
FOLIO_LOG = (" 50%|#####     | 2/4 [00:01<00:01,  1.43step/s, loss=4.1, tok_s=1,638,400]\r                     step 2: "
             "train loss 4.3642, val loss 4.4018\n 75%|#######5  | 3/4 [00:02<00:01, 1.5step/s, loss=3.9, "
             "tok_s=819,200]\rstep 4: train loss 3.6012, val loss 3.7408\n")


def test_results_go_to_a_folder_named_after_the_gpu() -> None:
    assert slug("NVIDIA H200") == "h200"
    assert slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert slug("") == "gpu"


def test_both_trainers_logs_give_their_evaluations_and_figures() -> None:
    assert read_evals(NANOGPT_LOG) == [(2, 3.8188, 3.8368), (4, 3.5031, 3.5008)]
    assert read_evals(FOLIO_LOG) == [(2, 4.3642, 4.4018), (4, 3.6012, 3.7408)]
    assert (iterations_done(NANOGPT_LOG), iterations_done(FOLIO_LOG), iterations_done("")) == (4, 3, 0)
    # tokens/s over the wall time from the iterations done; the median iteration from the bar's 10 and 20 ms
    run = summarize(FOLIO_LOG, seconds=2.0, flops_per_token=1e6, peak=1e9)
    assert (run["val_loss_last"], run["val_loss_best"]) == (3.7408, 3.7408)
    assert run["tokens_per_s_overall"] == 3 * TOKENS_PER_ITER / 2.0
    assert run["mfu_overall"] == pytest.approx(1e6 * 3 * TOKENS_PER_ITER / 2.0 / 1e9)
    assert run["iteration_ms_median"] == pytest.approx(15.0)
    assert summarize(NANOGPT_LOG, 1.0, 1.0, 1.0)["iteration_ms_median"] == pytest.approx(12.0)  # of 605, 10, 12
    assert summarize("", 1.0, 1.0, 1.0)["val_loss_last"] is None
