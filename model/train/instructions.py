"""Instruction data: a JSONL file, one example a line, as `{"messages": [...]}` (a conversation, rendered with the
model's chat template) or `{"prompt": ..., "completion": ...}` (plain text), made into rows whose loss counts only
what the model is to say.

- A conversation is rendered as a server renders it (model/chat_template.py: the template the checkpoint carries,
  else the default): for each assistant message, the prompt a server would send for the messages before it
  (`add_generation_prompt`) is context, and what rendering the assistant message adds after that prompt is the
  completion. Each piece is tokenized on its own, so the context's tokens are exactly those of the prompt served
  later. Messages after the last assistant one teach nothing and are dropped.
- A prompt/completion pair is the prompt's tokens as context, then the completion's and the tokenizer's
  end-of-text token (GPT-2's `<|endoftext|>`; a character tokenizer has none) as completion.
- Labels: the next token where it belongs to a completion, `IGNORE_INDEX` (-1) elsewhere: cross-entropy with
  `ignore_index=-1` gives a context token no gradient at all.
- Padding, not packing: one example per row, cut to `block_size + 1` tokens (an example whose completion starts
  beyond that is refused, naming its line); a batch's rows are padded to its longest with token 0 and label -1.
  The causal mask keeps padding at a row's end from reaching its tokens, so rows never see each other.
- Split: the last 10% of the examples (at least one) are the validation set, the rest train; batches draw
  examples uniformly with the run's generator.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.chat_template import resolve_chat_template, special_tokens
from model.data import TRAIN_FRACTION, DataError, make_tokenizer
from model.sampling_params import ValidationError
from model.tokenizer import BPETokenizer, CharTokenizer, TokenizerError

IGNORE_INDEX = -1
PAD_ID = 0  # what a padded position holds; its label is IGNORE_INDEX, and causal attention hides it
Piece = tuple[str, bool]  # text, and whether it is completion (trained on)


@dataclass
class Example:
    ids: np.ndarray  # (n,) int64 token ids
    labels: np.ndarray  # (n - 1,) the target of position i: ids[i + 1], or IGNORE_INDEX where it is context


@dataclass
class InstructionDataset:
    train: list[Example]
    val: list[Example]
    tokenizer: CharTokenizer | BPETokenizer
    sha256: str  # of the JSONL file

    def batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` examples drawn uniformly: inputs and labels (B, T), padded to the longest row (T <=
        block_size), padding PAD_ID with label IGNORE_INDEX."""
        examples = self.train if split == "train" else self.val
        picked = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=generator).tolist()]
        t = max(len(e.labels) for e in picked)
        x = torch.full((batch_size, t), PAD_ID, dtype=torch.long)
        y = torch.full((batch_size, t), IGNORE_INDEX, dtype=torch.long)
        for row, e in enumerate(picked):
            x[row, : len(e.labels)] = torch.from_numpy(e.ids[:-1])
            y[row, : len(e.labels)] = torch.from_numpy(e.labels)
        return x.to(device), y.to(device)


def is_jsonl(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".jsonl"


def render_pieces(record: object, tokenizer: CharTokenizer | BPETokenizer, where: str) -> list[Piece]:
    """One JSONL record as context and completion pieces of text (the module docstring says how)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with 'messages', or 'prompt' and 'completion'")
    if "messages" in record:
        return _conversation(record["messages"], tokenizer, where)
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
        raise DataError(f"{where}: expected 'messages' (a conversation), or 'prompt' and a non-empty 'completion' "
                        f"as strings; got the keys {sorted(record)[:10]}")
    return [(prompt, False), (completion, True)]


def _conversation(messages: object, tokenizer: CharTokenizer | BPETokenizer, where: str) -> list[Piece]:
    template = resolve_chat_template(tokenizer.chat_template)
    tokens = special_tokens(tokenizer)
    if not isinstance(messages, list) or not any(isinstance(m, dict) and m.get("role") == "assistant"
                                                 for m in messages):
        raise DataError(f"{where}: 'messages' must be a list of messages with at least one from the assistant")
    if isinstance(messages[0], dict) and messages[0].get("role") == "assistant":
        raise DataError(f"{where}: the conversation starts with the assistant; a prompt must come first")
    pieces: list[Piece] = []
    done = ""
    try:
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and message.get("role") == "assistant"):
                continue
            prompt = template.render(messages[:i], add_generation_prompt=True, **tokens)
            full = template.render(messages[: i + 1], add_generation_prompt=False, **tokens)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError(f"{where}: the chat template ({template.source}) does not render messages[{i}] as a "
                                "continuation of the prompt before it, so its tokens cannot be told apart")
            pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
    except ValidationError as e:
        raise DataError(f"{where}: {e}") from None
    return pieces


def tokenize(pieces: list[Piece], tokenizer: CharTokenizer | BPETokenizer, block_size: int, where: str,
             *, end_of_text: bool = False) -> Example:
    """Pieces -> one example, cut to block_size + 1 tokens; `end_of_text` appends the tokenizer's end-of-text token
    (if it has one) as completion."""
    ids: list[int] = []
    trained: list[bool] = []
    try:
        for text, is_completion in pieces:
            piece = tokenizer.encode(text)
            ids += piece
            trained += [is_completion] * len(piece)
    except TokenizerError as e:
        raise DataError(f"{where}: {e}") from None
    if end_of_text and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
        trained.append(True)
    ids, trained = ids[: block_size + 1], trained[: block_size + 1]
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])]
    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(f"{where}: no completion token within the first {block_size + 1} tokens (block_size "
                        f"{block_size}): shorten the prompt or train with a longer block")
    return Example(np.array(ids, dtype=np.int64), np.array(labels, dtype=np.int64))


def prepare_instructions(path: str | Path, *, tokenizer: str | CharTokenizer | BPETokenizer, block_size: int,
                         bpe_dir: str | None = None) -> InstructionDataset:
    """Read, render and tokenize a JSONL file of examples (the module docstring says how)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    raw = path.read_bytes()
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: {e}") from None
    records: list[tuple[str, Any]] = []
    for n, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n} is not JSON: {e}") from None
    if len(records) < 2:
        raise DataError(f"{path}: {len(records)} example(s); at least 2 are needed (one for validation)")
    placeholder = tokenizer if not isinstance(tokenizer, str) else CharTokenizer([" "])
    rendered = [(where, render_pieces(record, placeholder, where), "messages" not in record)
                for where, record in records]
    text = "".join(t for _, pieces, _ in rendered for t, _ in pieces)
    tok = make_tokenizer(tokenizer, text, bpe_dir)
    if tok is not placeholder:  # a fresh tokenizer: render again, with its own special tokens
        rendered = [(where, render_pieces(record, tok, where), "messages" not in record) for where, record in records]
    examples = [tokenize(pieces, tok, block_size, where, end_of_text=pair) for where, pieces, pair in rendered]
    n_train = min(len(examples) - 1, max(1, int(len(examples) * TRAIN_FRACTION)))
    return InstructionDataset(examples[:n_train], examples[n_train:], tok, hashlib.sha256(raw).hexdigest())
