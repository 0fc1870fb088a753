"""Looking inside the model for one text: attention maps, the logit lens, and each token's probability and
alternatives. Offline: `inspect(checkpoint, ids)`; the engine runs the same `Inspector` one layer per step between
its decode steps; `python -m model.inspection` draws the maps as PNG.

- attention: for the chosen layers and heads, each query position's weights over positions 0..query, computed
  from the queries and keys of the model's own blocks (`block_attention`: a hook on each block's `c_attn`,
  whatever computes it: torch, the CPU kernels, quantized weights; the engine's streamed attention captures a
  generated token's the same way) as softmax(q k^T / sqrt(head_size)) with the causal mask. Dense (every
  weight) up to `dense_max_tokens` tokens, else sparse: per query the `sparse_top` largest weights of at least
  `sparse_threshold` (stated in the result).
- logit lens: the residual stream after the embeddings (layer 0) and after each block (1..n_layer), put through
  the final LayerNorm and the LM head: the `lens_top` most likely next tokens (at most the vocabulary) and their
  probabilities at each position. At the last layer that is exactly the model's own next-token distribution.
- next tokens: each token's log-probability given those before it and its `top_n` alternatives (`PromptScorer`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from model.checkpoint import CheckpointError, load_checkpoint
from model.cli import ArgumentParser, add_checkpoint_option
from model.gpt import GPT, CacheStep, KVCache
from model.sampler import usable_logits
from model.scoring import PromptScorer, PromptToken, TopToken
from model.tokenizer import Tokenizer, TokenizerError, token_spans

# what one inspection may ask for, so that a client cannot make the server compute or send without bound
# (both admit GPT-2 small's whole context with every layer and head: 144 x 1,024 rows, 13 x 1,024 x 50,257 logits)
MAX_ATTENTION_ROWS = 200_000  # (layer, head, query) rows of attention in one answer
MAX_LENS_LOGITS = 700_000_000  # lens rows (layers x positions) times the vocabulary: the LM head's work
MAX_TOP = 20
LENS_STEP_LOGITS = 1_000_000  # the LM head's outputs in one engine step (positions x vocabulary): GPT-2's 19 rows


class InspectError(ValueError):
    """An inspection outside the limits; `field` names the option, the message the limit and the value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InspectTooLarge(InspectError):
    """An inspection over one of the budgets (attention rows, the logit lens' work): not a wrong value but too
    much asked at once."""


@dataclass(frozen=True)
class InspectOptions:
    layers: tuple[int, ...] | None = None  # attention of these layers (0-based); None: all
    heads: tuple[int, ...] | None = None  # and these heads; None: all
    attention: bool = True
    dense_max_tokens: int = 128  # dense attention up to this many tokens, sparse beyond
    sparse_threshold: float = 0.02
    sparse_top: int = 8
    lens: bool = True
    lens_layers: tuple[int, ...] | None = None  # 0 (embeddings) .. n_layer; None: all
    lens_top: int = 5
    top_n: int = 5  # alternatives of each actual next token
    decimals: int | None = None  # attention weights and lens probabilities rounded to this many decimals


@dataclass
class HeadAttention:
    layer: int
    head: int
    weights: list[list[float]]  # per query position: dense, weights over keys 0..query; sparse: the kept weights
    keys: list[list[int]] | None = None  # sparse only: the key positions of `weights`


@dataclass
class LensLayer:
    layer: int  # 0: the embeddings; l: after block l
    top: list[list[tuple[int, float]]]  # per position: (id, probability), most likely first


@dataclass
class Inspection:
    tokens: list[int]
    spans: list[tuple[str, int, int]]  # each token's text and character offsets
    dense: bool
    sparse_threshold: float | None
    attention: list[HeadAttention] = field(default_factory=list)
    lens: list[LensLayer] = field(default_factory=list)
    next_tokens: list[PromptToken] = field(default_factory=list)


def check_options(options: InspectOptions, n_tokens: int, model: GPT, n_vocab: int) -> None:
    """Refuse an inspection outside the limits before any work (`InspectError` naming the option)."""
    cfg = model.config
    if not 1 <= n_tokens <= cfg.block_size:
        raise InspectError("text", f"must be 1 to {cfg.block_size} tokens (the model's context), got {n_tokens}")
    for name, values, limit in (("layers", options.layers, cfg.n_layer), ("heads", options.heads, cfg.n_head),
                                ("lens_layers", options.lens_layers, cfg.n_layer + 1)):
        bad = [v for v in values or () if not 0 <= v < limit]
        if bad:
            raise InspectError(name, f"must be in [0, {limit - 1}], got {bad[:5]}")
    for name, value in (("lens_top", options.lens_top), ("top_n", options.top_n), ("sparse_top", options.sparse_top)):
        if not 0 <= value <= MAX_TOP:
            raise InspectError(name, f"must be in [0, {MAX_TOP}], got {value}")
    rows = len(options.layers or range(cfg.n_layer)) * len(options.heads or range(cfg.n_head)) * n_tokens
    if options.attention and rows > MAX_ATTENTION_ROWS:
        raise InspectTooLarge("layers", f"layers x heads x tokens is {rows}, more than {MAX_ATTENTION_ROWS}: choose "
                                     "fewer layers or heads, or a shorter text")
    lens_rows = len(options.lens_layers or range(cfg.n_layer + 1)) * n_tokens
    if options.lens and lens_rows * n_vocab > MAX_LENS_LOGITS:
        raise InspectTooLarge("lens_layers", f"lens layers x tokens x vocabulary is {lens_rows * n_vocab}, more than "
                                          f"{MAX_LENS_LOGITS}: choose fewer lens layers or a shorter text")


def block_attention(block: nn.Module, x: torch.Tensor, cache: CacheStep | None = None,
                    heads: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model's own `block` (`model.gpt.Block`) on x (B, T, C), through `cache` where given, and capture the
    attention it computed: (its output (B, T, C), the weights (B, heads, T, keys) in float32 for `heads`, default
    all). The weights are softmax(q k^T / sqrt(head_size)) of the queries its `c_attn` returned (a hook: whatever
    computes it, torch, the CPU kernels, quantized weights) over the keys its attention read: the forward's own
    under the causal mask, or, with a cache, what the step's `read` gives (as stored) under the step's mask."""
    captured: list[torch.Tensor] = []
    handle = block.attn.c_attn.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        y = block(x, cache)
    finally:
        handle.remove()
    B, T, C = x.shape
    n_head = block.attn.n_head
    hs = C // n_head
    q, k, _ = captured[0].split(C, dim=-1)
    q = q.view(B, T, n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
    if cache is None:
        keys = k.view(B, T, n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        visible = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    else:
        keys, visible = cache.read(block.attn.layer)[0], cache.mask  # (B, nh, kv_len, hs), (B, 1, T, kv_len)
    if heads is not None:
        q, keys = q[:, heads], keys[:, heads]
    scores = (q.float() @ keys.float().transpose(-2, -1)) / math.sqrt(hs)  # (B, heads, T, keys): query x key
    return y, scores.masked_fill(~visible, float("-inf")).softmax(-1)


class Inspector:
    """One inspection as steps: `steps()` does the embeddings, then one block per step, then the final scores, and
    ends with the result (`result`). The engine runs one step between two of its decode steps."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, ids: list[int], options: InspectOptions, *,
                 kv_dtype: torch.dtype | None = None) -> None:
        check_options(options, len(ids), model, tokenizer.n_vocab)
        # alternatives and lens entries: at most the whole vocabulary (a 2-symbol model asked for the default 5 gets
        # both of its tokens), as a sparse map keeps at most the keys there are
        options = replace(options, lens_top=min(options.lens_top, tokenizer.n_vocab),
                          top_n=min(options.top_n, tokenizer.n_vocab))
        self.model, self.tokenizer, self.ids, self.options = model, tokenizer, ids, options
        # keys and values as the serving cache stores them (an fp16 cache rounds them): the maps and every layer
        # after show what the served model computes; None: as the forward computes them
        self.kv_dtype = kv_dtype
        cfg = model.config
        self.layers = set(options.layers if options.layers is not None else range(cfg.n_layer))
        self.heads = list(options.heads if options.heads is not None else range(cfg.n_head))
        self.lens_layers = set(options.lens_layers if options.lens_layers is not None else range(cfg.n_layer + 1))
        dense = len(ids) <= options.dense_max_tokens
        self.result = Inspection(ids, token_spans(tokenizer, ids), dense, None if dense else options.sparse_threshold)

    def steps(self) -> Iterator[None]:
        device = self.model.transformer.wte.weight.device
        idx = torch.tensor([self.ids], device=device)
        with torch.inference_mode():
            positions = torch.arange(len(self.ids), device=device)
            x = self.model.embed(idx, positions)
            cache = None
            if self.kv_dtype not in (None, x.dtype):  # the text as one prompt into a cache of that type: attention
                kv = KVCache(self.model.config, 1, max_len=len(self.ids), device=device, dtype=self.kv_dtype)
                cache = kv.step(positions[None])  # reads the keys and values as stored
            yield from self._read_out(0, x)
            yield
            for layer, block in enumerate(self.model.transformer.h):
                x = self._block(layer, block, x, cache)
                yield from self._read_out(layer + 1, x)
                yield

    def run(self) -> Inspection:
        for _ in self.steps():
            pass
        return self.result

    def _block(self, layer: int, block: nn.Module, x: torch.Tensor, cache: CacheStep | None) -> torch.Tensor:
        if not (self.options.attention and layer in self.layers):
            return block(x, cache)
        y, weights = block_attention(block, x, cache, self.heads)
        for head, head_weights in zip(self.heads, weights[0]):
            self.result.attention.append(self._head(layer, head, head_weights))
        return y

    def _rounded(self, values: torch.Tensor) -> list:
        d = self.options.decimals
        return (values if d is None else values.double().round(decimals=d)).tolist()

    def _head(self, layer: int, head: int, weights: torch.Tensor) -> HeadAttention:
        """One head's map from its weights (T, T): query x key, zero above the diagonal."""
        if self.result.dense:
            rows = self._rounded(weights)
            return HeadAttention(layer, head, [row[: q + 1] for q, row in enumerate(rows)])
        top = torch.topk(weights, min(self.options.sparse_top, weights.size(-1)), dim=-1)
        keys, kept = [], []
        for values, positions in zip(self._rounded(top.values), top.indices.tolist()):
            pairs = [(p, v) for p, v in zip(positions, values) if v >= self.options.sparse_threshold]
            keys.append([p for p, _ in pairs])
            kept.append([v for _, v in pairs])
        return HeadAttention(layer, head, kept, keys)

    def _read_out(self, layer: int, x: torch.Tensor) -> Iterator[None]:
        """The residual stream after `layer` through the final LayerNorm and the LM head: the logit lens there (if
        asked) and, after the last block, each token's score. A chunk of positions at a time, a step between two
        chunks: the LM head is the largest work of an inspection (positions x vocabulary)."""
        lens = self.options.lens and layer in self.lens_layers
        last = layer == self.model.config.n_layer
        if not (lens or last):
            return
        rows = max(1, LENS_STEP_LOGITS // self.model.config.vocab_size)
        scorer = PromptScorer(self.ids, self.options.top_n, self.tokenizer.n_vocab, self._describe)
        top: list[list[tuple[int, float]]] = []
        for start in range(0, x.size(1), rows):
            if start:
                yield
            logits = self.model.logits(x[:, start : start + rows])[0]
            if lens:
                probs = torch.softmax(usable_logits(logits.float(), self.tokenizer.n_vocab), dim=-1)
                best = torch.topk(probs, self.options.lens_top, dim=-1)
                top += [list(zip(i, p)) for i, p in zip(best.indices.tolist(), self._rounded(best.values))]
            if last:
                scorer.add(start, logits)
        if lens:
            self.result.lens.append(LensLayer(layer, top))
        if last:
            self.result.next_tokens = scorer.tokens

    def _describe(self, token: int) -> TopToken:
        return TopToken(token, self.tokenizer.decode([token]), 0.0, token == self.tokenizer.eos_id)


def inspect(model: GPT, tokenizer: Tokenizer, ids: list[int], options: InspectOptions | None = None, *,
            kv_dtype: torch.dtype | None = None) -> Inspection:
    """The whole inspection at once (offline use; the engine steps an `Inspector` itself, with its cache's type)."""
    return Inspector(model, tokenizer, ids, options or InspectOptions(), kv_dtype=kv_dtype).run()


def save_heatmaps(result: Inspection, out: Path, decode: Callable[[int], str]) -> list[Path]:
    """One PNG per (layer, head) attention map (query x key) and one for the logit lens (its cells labelled with
    `decode(id)`); the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    labels = [text for text, _, _ in result.spans]
    n = len(result.tokens)
    written = []
    for head in result.attention:
        grid = torch.zeros(n, n)
        for q, row in enumerate(head.weights):
            keys = head.keys[q] if head.keys is not None else range(len(row))
            for kpos, w in zip(keys, row):
                grid[q, kpos] = w
        fig, ax = plt.subplots(figsize=(6, 5.5))
        im = ax.imshow(grid.numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set(title=f"layer {head.layer} head {head.head}", xlabel="key", ylabel="query")
        if n <= 48:
            ax.set_xticks(range(n), [repr(t)[1:-1] for t in labels], rotation=90, fontsize=7)
            ax.set_yticks(range(n), [repr(t)[1:-1] for t in labels], fontsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        path = out / f"attention-L{head.layer}-H{head.head}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if result.lens:
        written.append(_save_lens(result, labels, out, plt, decode))
    return written


def _save_lens(result: Inspection, labels: list[str], out: Path, plt, decode: Callable[[int], str]) -> Path:  # noqa: ANN001
    n = len(result.tokens)
    probs = torch.tensor([[pos[0][1] for pos in layer.top] for layer in result.lens])
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * n), 0.5 * len(result.lens) + 1.5))
    ax.imshow(probs.numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
    for r, layer in enumerate(result.lens):
        for c, pos in enumerate(layer.top):
            if n <= 64:
                colour = "white" if pos[0][1] > 0.55 else "black"
                ax.text(c, r, repr(decode(pos[0][0]))[1:-1], ha="center", va="center", fontsize=6, color=colour)
    ax.set(title="logit lens: top next token per layer and position", xlabel="position", ylabel="layer")
    ax.set_yticks(range(len(result.lens)), [str(layer.layer) for layer in result.lens])
    if n <= 64:
        ax.set_xticks(range(n), [repr(t)[1:-1] for t in labels], rotation=90, fontsize=7)
    fig.tight_layout()
    path = out / "logit-lens.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m model.inspection", description="Draw a text's attention maps and "
                                "logit lens as PNG files.")
    add_checkpoint_option(p)
    p.add_argument("--text", required=True, help="the text to look into")
    p.add_argument("--out", required=True, type=Path, help="directory for the PNG files")
    p.add_argument("--layers", type=int, nargs="*", help="layers whose attention to draw (default: all)")
    p.add_argument("--heads", type=int, nargs="*", help="heads to draw (default: all)")
    args = p.parse_args(argv)
    try:
        ck = load_checkpoint(args.checkpoint)
        ids = ck.tokenizer.encode(args.text)
        opts = InspectOptions(layers=tuple(args.layers) if args.layers else None,
                              heads=tuple(args.heads) if args.heads else None, dense_max_tokens=10**6)
        result = inspect(ck.model, ck.tokenizer, ids, opts)
    except (CheckpointError, TokenizerError, InspectError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in save_heatmaps(result, args.out, lambda t: ck.tokenizer.decode([t])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
