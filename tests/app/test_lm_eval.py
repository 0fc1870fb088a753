"""lm-evaluation-harness as a real client: `lm_eval --model local-completions` against a running server, on two
tasks defined in local files (no download): a multiple-choice (loglikelihood) task and a generation task. Its
scores must equal the ones computed here directly from the model's logits and its greedy loop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import generate_naive
from model.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CHOICE_DOCS = [
    {"context": "ROMEO: what light", "choices": [" through", " yonder", " breaks"], "label": 1},
    {"context": "JULIET: O Romeo", "choices": [", Romeo", " wherefore", "!"], "label": 0},
    {"context": "First Citizen:", "choices": [" Before", " we", " proceed"], "label": 2},
]
GEN_DOCS = [{"context": "KING: ", "target": "x"}, {"context": "QUEEN:", "target": "y"}]
MAX_GEN = 6


def write_tasks(directory: Path) -> None:
    for name, docs in (("choice", CHOICE_DOCS), ("gen", GEN_DOCS)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{context}}\"\n"
    (directory / "folio_choice.yaml").write_text(
        f"task: folio_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ntarget_delimiter: \"\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n")
    (directory / "folio_gen.yaml").write_text(
        f"task: folio_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'gen.jsonl'}\n"
        "output_type: generate_until\ntarget_delimiter: \"\"\ndoc_to_target: \"{{target}}\"\n"
        f"generation_kwargs:\n  until: [\"\\n\\n\\n\"]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")


def run_lm_eval(base: str, tasks: Path, out: Path) -> list[dict]:
    exe = shutil.which("lm_eval")
    if exe is None:
        pytest.skip("lm-eval is not installed (pip install -c constraints.txt -e '.[test]' installs it)")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, exe, "--model", "local-completions", "--model_args",
            f"base_url={base}/v1/completions,model=tiny-char,tokenizer_backend=remote,num_concurrent=1,"
            "max_retries=1,tokenized_requests=True", "--tasks", "folio_choice,folio_gen", "--include_path",
            str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "1"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for path in sorted(out.rglob("samples_*.jsonl")) for line in path.read_text().splitlines()]


def loglikelihood(model: torch.nn.Module, n_vocab: int, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0, :, :n_vocab].double()
    rows = torch.log_softmax(logits, dim=-1)
    return sum(rows[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))


def test_lm_eval_scores_equal_the_models_own(server: str, char_checkpoint: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    samples = run_lm_eval(server, tasks, tmp_path / "out")
    ck = load_checkpoint(char_checkpoint)
    tok, n_vocab = ck.tokenizer, ck.tokenizer.n_vocab
    choice = [s for s in samples if "choices" in s["doc"]]
    gen = [s for s in samples if "target" in s["doc"]]
    assert len(choice) == len(CHOICE_DOCS) and len(gen) == len(GEN_DOCS)
    for s in choice:
        doc = s["doc"]
        want = [loglikelihood(ck.model, n_vocab, tok.encode(doc["context"]), tok.encode(c)) for c in doc["choices"]]
        got = [float(r[0][0]) for r in s["resps"]]  # lm-eval logs (loglikelihood, is_greedy) as strings
        assert got == pytest.approx(want, abs=1e-4), doc
        assert s["acc"] == float(max(range(len(want)), key=want.__getitem__) == doc["label"])
    for s in gen:
        prompt = tok.encode(s["doc"]["context"])
        ids = [t for t, _ in generate_naive(ck.model, prompt, SamplingParams(max_new_tokens=MAX_GEN, greedy=True),
                                            n_vocab=n_vocab)]
        want = tok.decode(ids).split("\n\n\n")[0]
        assert s["resps"][0][0] == want
        assert s["exact_match"] == float(want == s["doc"]["target"])
