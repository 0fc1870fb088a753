"""Converters from other GPT-2 formats into Folio checkpoints, as functions and a CLI.

    python -m model.convert hf SRC_DIR OUT_DIR [--bpe-dir DIR]
    python -m model.convert nanogpt CKPT_PT OUT_DIR [--meta META_PKL] [--bpe-dir DIR]

`hf` reads a directory written by `transformers`' `GPT2LMHeadModel.save_pretrained` (`config.json` plus
`model.safetensors`) with `safetensors` alone: `transformers` is not needed at runtime, and
`pytorch_model.bin` (a pickle) is refused. GPT-2's `Conv1D` stores weights as (in, out); they are transposed
to `nn.Linear`'s (out, in). HF configs Folio cannot represent are refused, naming the setting. The repo's chat
template is kept in the checkpoint (`hf_chat_template`: `chat_template.jinja`, as transformers saves it now, else
`tokenizer_config.json`'s `chat_template`, a string or a list of named templates, of which "default" is taken).

`nanogpt` reads nanoGPT's `ckpt.pt` with `torch.load(weights_only=True)` (tensors and plain containers, no
code) and, for a character-level model, its `meta.pkl` through an unpickler that refuses every global, which
is enough for nanoGPT's `{'vocab_size', 'itos', 'stoi'}`. Without `meta.pkl` the tokenizer is GPT-2's BPE,
as in nanoGPT.

Both write the weights in float32 with the source's sha256 in the checkpoint's training provenance. `read_model`
reads any of these sources, or a Folio checkpoint, into memory without writing anything (`folio train --init-from`,
`folio merge`).
Converters raise `ConvertError` with a message saying what is wrong and how to fix it; the CLI prints it and
exits with status 2.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from model.chat_template import CHECKPOINT, ChatTemplate
from model.checkpoint import FORMAT, CheckpointError, load_checkpoint, save_checkpoint
from model.cli import ArgumentParser
from model.config import GPTConfig
from model.files import sha256_file
from model.gpt import GPT
from model.tokenizer import BPETokenizer, CharTokenizer, TokenizerError, gpt2_tokenizer

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
HF_CHAT_TEMPLATE_FILE = "chat_template.jinja"
# HF GPT-2 keeps these Linear-like layers as Conv1D, weight (in, out); nn.Linear wants (out, in)
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# causal-mask buffers some GPT-2 and nanoGPT versions save with the weights; not parameters
MASK_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
COMPILE_PREFIX = "_orig_mod."  # torch.compile's wrapper prefixes every key with this
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # the same function: GELU with the tanh approximation


class ConvertError(ValueError):
    """A source that cannot be converted; the message names the file and what is wrong with it."""


# --- Hugging Face GPT-2 -------------------------------------------------------------------------------------


def hf_config_to_gpt_config(hf: dict[str, Any], source: str = HF_CONFIG_FILE) -> GPTConfig:
    """Map a GPT-2 `config.json` to a `GPTConfig`, refusing settings the Folio GPT does not implement."""
    if not isinstance(hf, dict):
        raise ConvertError(f"{source}: expected a JSON object")
    model_type = hf.get("model_type")
    if model_type != "gpt2":
        raise ConvertError(f"{source}: model_type is {model_type!r}; only 'gpt2' models can be converted")
    # (setting, the value Folio implements, the default when the key is absent)
    required: list[tuple[str, Any, Any]] = [
        ("layer_norm_epsilon", 1e-5, 1e-5),
        ("scale_attn_weights", True, True),
        ("scale_attn_by_inverse_layer_idx", False, False),
        ("reorder_and_upcast_attn", False, False),
        ("add_cross_attention", False, False),
        ("tie_word_embeddings", True, True),
    ]
    for key, want, default in required:
        got = hf.get(key, default)
        if got != want:
            raise ConvertError(f"{source}: {key}={got!r} is not supported; Folio's GPT implements {key}={want!r}")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GELU_TANH:
        raise ConvertError(
            f"{source}: activation_function={activation!r} is not supported; Folio's GPT uses 'gelu_new'"
        )
    try:
        n_layer, n_head, n_embd = hf["n_layer"], hf["n_head"], hf["n_embd"]
        block_size, vocab_size = hf["n_positions"], hf["vocab_size"]
    except KeyError as e:
        raise ConvertError(f"{source}: missing GPT-2 setting {e.args[0]!r}") from None
    n_inner = hf.get("n_inner")
    if n_inner is not None and n_inner != 4 * n_embd:
        raise ConvertError(
            f"{source}: n_inner={n_inner!r} is not supported; Folio's MLP width is 4 * n_embd = {4 * n_embd}"
        )
    try:
        return GPTConfig(
            block_size=block_size,
            vocab_size=vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=0.0,
            bias=True,
        )
    except ValueError as e:
        raise ConvertError(f"{source}: {e}") from None


def load_hf_gpt2(src_dir: str | os.PathLike[str]) -> GPT:
    """Read a `save_pretrained` GPT-2 directory into a Folio `GPT` (float32, eval mode), no tokenizer."""
    src = Path(src_dir)
    if not src.is_dir():
        raise ConvertError(f"Hugging Face model directory not found: {src}")
    config_path, weights_path = src / HF_CONFIG_FILE, src / HF_WEIGHTS_FILE
    if not config_path.is_file():
        raise ConvertError(f"{config_path} is missing: expected a directory written by save_pretrained")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{config_path} is not valid JSON: {e}") from None
    config = hf_config_to_gpt_config(hf_config, str(config_path))
    if not weights_path.is_file():
        if (src / f"{HF_WEIGHTS_FILE}.index.json").is_file():
            raise ConvertError(
                f"{src} holds a sharded checkpoint; re-save it as one file with "
                "save_pretrained(dir, max_shard_size='100GB')"
            )
        pickles = sorted(p.name for p in src.glob("*.bin")) + sorted(p.name for p in src.glob("*.pt*"))
        if pickles:
            raise ConvertError(
                f"{src} has {', '.join(pickles)} but no {HF_WEIGHTS_FILE}: those are pickles, which Folio never "
                "loads; where you trust the file, re-save it with save_pretrained(dir) (safetensors by default)"
            )
        raise ConvertError(f"{weights_path} is missing")
    state = _read_hf_weights(weights_path)
    return _build_model(config, state, str(weights_path))


def _read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors under Folio names and layouts. Keys may lack the `transformer.` prefix (GPT2Model)."""
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                name = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
                if name.endswith(MASK_BUFFER_SUFFIXES):
                    continue
                t = f.get_tensor(key)
                if not t.is_floating_point():
                    raise ConvertError(f"{path}: tensor {key} has dtype {t.dtype}, expected a float type")
                if name.endswith(CONV1D_SUFFIXES):
                    if t.dim() != 2:
                        raise ConvertError(f"{path}: Conv1D weight {key} has shape {tuple(t.shape)}, expected 2-D")
                    t = t.t()  # Conv1D (in, out) -> nn.Linear (out, in)
                state[name] = t.to(torch.float32).contiguous()
    except SafetensorError as e:
        raise ConvertError(f"{path} is not a readable safetensors file ({e}); it may be truncated") from None
    return state


def hf_chat_template(src_dir: str | os.PathLike[str]) -> str | None:
    """The chat template of a Hugging Face repo directory, or None: `chat_template.jinja` (transformers' file), else
    `tokenizer_config.json`'s `chat_template`, a string or a list of `{"name", "template"}` of which "default" is
    the one transformers uses without being told. Refuses one that does not compile, naming the file."""
    src = Path(src_dir)
    jinja_path, config_path = src / HF_CHAT_TEMPLATE_FILE, src / HF_TOKENIZER_CONFIG_FILE
    if jinja_path.is_file():
        source = str(jinja_path)
        try:
            template = jinja_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConvertError(f"{jinja_path} is not UTF-8 text: {e}") from None
    elif config_path.is_file():
        source = f"{config_path}'s chat_template"
        try:
            template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ConvertError(f"{config_path} is not a JSON object: {e}") from None
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ConvertError(f"{source} lists named templates ({', '.join(map(repr, named))}) and none is "
                                   "named 'default', the one a chat without a template name uses")
            template = named["default"]
        if template is not None and not isinstance(template, str):
            raise ConvertError(f"{source} is a {type(template).__name__}, not a template's text")
    else:
        return None
    if template is not None and (problem := ChatTemplate(template, CHECKPOINT).problem) is not None:
        raise ConvertError(f"{source} does not compile as a Jinja2 chat template: {problem}")
    return template


def convert_hf(
    src_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    bpe_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Convert a Hugging Face GPT-2 directory into a Folio checkpoint with GPT-2's BPE tokenizer and the
    directory's chat template, if it has one."""
    src, out = Path(src_dir), Path(out_dir)
    _refuse_same_dir(src, out)
    return _save(out, *read_hf(src, bpe_dir=bpe_dir))


def read_hf(
    src_dir: str | os.PathLike[str], *, bpe_dir: str | os.PathLike[str] | None = None
) -> tuple[GPT, BPETokenizer, dict[str, Any]]:
    """A Hugging Face GPT-2 directory as a Folio model, its tokenizer (GPT-2's BPE and the directory's chat template)
    and the provenance a checkpoint of it records."""
    src = Path(src_dir)
    model = load_hf_gpt2(src)
    tokenizer = _gpt2_bpe(bpe_dir)
    tokenizer.chat_template = hf_chat_template(src)
    if tokenizer.n_vocab > model.config.vocab_size:
        raise ConvertError(
            f"{src / HF_CONFIG_FILE}: vocab_size {model.config.vocab_size} is smaller than GPT-2's BPE "
            f"({tokenizer.n_vocab} tokens); only models with GPT-2's vocabulary can be converted"
        )
    training = {
        "converted_from": "huggingface-gpt2",
        "source": str(src.resolve()),
        "source_sha256": sha256_file(src / HF_WEIGHTS_FILE),
    }
    return model, tokenizer, training


# --- nanoGPT ------------------------------------------------------------------------------------------------


class _ForbiddenGlobal(pickle.UnpicklingError):
    """The pickle asked for a class or function: refused before anything is imported or called."""


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Builds only pickle's plain types (dict, list, str, int, ...): any class or function is refused, so
    loading cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise _ForbiddenGlobal(f"global '{module}.{name}' is forbidden")


def read_meta_pkl(path: str | os.PathLike[str]) -> CharTokenizer:
    """Parse nanoGPT's `meta.pkl` (`{'vocab_size': int, 'itos': {int: str}, 'stoi': {str: int}}`) safely into
    a `CharTokenizer`; anything that needs a global to unpickle is refused before it is built."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"meta file not found: {path}")
    try:
        meta = _NoGlobalsUnpickler(io.BytesIO(path.read_bytes())).load()
    except _ForbiddenGlobal as e:
        raise ConvertError(
            f"{path} was refused: {e}. Only plain data (dicts, strings, numbers) is read from meta.pkl, "
            "nothing that imports code"
        ) from None
    except Exception as e:  # truncated or not a pickle at all: EOFError, ValueError, ...
        raise ConvertError(f"{path} is not a readable pickle: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("itos"), dict):
        raise ConvertError(f"{path}: expected nanoGPT's meta dict with an 'itos' mapping of ids to characters")
    itos = meta["itos"]
    n = len(itos)
    if any(not isinstance(i, int) or isinstance(i, bool) for i in itos) or set(itos) != set(range(n)):
        raise ConvertError(f"{path}: 'itos' keys must be the token ids 0..{n - 1}")
    chars = [itos[i] for i in range(n)]
    if any(not isinstance(c, str) or len(c) != 1 for c in chars):
        raise ConvertError(f"{path}: 'itos' values must be single characters (a character-level vocabulary)")
    if "vocab_size" in meta and meta["vocab_size"] != n:
        raise ConvertError(f"{path}: vocab_size {meta['vocab_size']!r} disagrees with the {n} entries of 'itos'")
    stoi = meta.get("stoi")
    if stoi is not None and stoi != {c: i for i, c in enumerate(chars)}:
        raise ConvertError(f"{path}: 'stoi' is not the inverse of 'itos'")
    try:
        return CharTokenizer(chars)
    except TokenizerError as e:
        raise ConvertError(f"{path}: {e}") from None


def load_nanogpt(ckpt_path: str | os.PathLike[str]) -> GPT:
    """Read nanoGPT's `ckpt.pt` (`model` state dict plus `model_args`) into a Folio `GPT` (float32, eval)."""
    path = Path(ckpt_path)
    if not path.is_file():
        raise ConvertError(f"nanoGPT checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses any global that is not a tensor or plain container: no code runs
        raise ConvertError(
            f"{path} was refused by torch.load(weights_only=True), which loads tensors and plain data only: {e}"
        ) from None
    except Exception as e:  # truncated zip, not a torch file, ...
        raise ConvertError(f"{path} is not a readable torch checkpoint: {type(e).__name__}: {e}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or "model_args" not in ckpt:
        raise ConvertError(f"{path}: expected nanoGPT's checkpoint dict with 'model' and 'model_args'")
    try:
        config = GPTConfig.from_dict(dict(ckpt["model_args"]))
    except (ValueError, TypeError) as e:
        raise ConvertError(f"{path}: bad model_args: {e}") from None
    state: dict[str, torch.Tensor] = {}
    for key, t in ckpt["model"].items():
        name = key.removeprefix(COMPILE_PREFIX)
        if name.endswith(MASK_BUFFER_SUFFIXES):
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ConvertError(f"{path}: model entry {key} is not a float tensor")
        state[name] = t.to(torch.float32).contiguous()
    return _build_model(config, state, str(path))


def convert_nanogpt(
    ckpt_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    meta_path: str | os.PathLike[str] | None = None,
    bpe_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Convert nanoGPT's `ckpt.pt` (+ `meta.pkl` for a char model, else GPT-2 BPE) into a Folio checkpoint."""
    src = Path(ckpt_path)
    model = load_nanogpt(src)
    tokenizer: CharTokenizer | BPETokenizer
    if meta_path is not None:
        tokenizer = read_meta_pkl(meta_path)
        hint = ""
    else:
        tokenizer = _gpt2_bpe(bpe_dir)
        hint = "; for a character-level model pass its meta.pkl with --meta"
    if tokenizer.n_vocab > model.config.vocab_size:
        raise ConvertError(
            f"the tokenizer has {tokenizer.n_vocab} tokens but the model's vocab_size is "
            f"{model.config.vocab_size}{hint}"
        )
    training: dict[str, Any] = {
        "converted_from": "nanogpt",
        "source": str(src.resolve()),
        "source_sha256": sha256_file(src),
    }
    if meta_path is not None:
        training["meta_sha256"] = sha256_file(Path(meta_path))
    return _save(Path(out_dir), model, tokenizer, training)


# --- any source ---------------------------------------------------------------------------------------------


def read_model(
    source: str | os.PathLike[str], *, bpe_dir: str | os.PathLike[str] | None = None
) -> tuple[GPT, CharTokenizer | BPETokenizer, dict[str, Any]]:
    """A model to start from (`folio train --init-from`, `folio merge`): a Folio checkpoint directory, a Hugging Face
    GPT-2 directory or a nanoGPT `ckpt.pt` (GPT-2's BPE; convert a character-level one with its meta.pkl first).
    Returns the model (float32, eval mode, on the CPU), its tokenizer and where it came from."""
    src = Path(source)
    if src.is_file():
        model = load_nanogpt(src)
        return model, _gpt2_bpe(bpe_dir), {"converted_from": "nanogpt", "source": str(src.resolve()),
                                           "source_sha256": sha256_file(src)}
    if not src.is_dir():
        raise ConvertError(f"{src} not found: expected a Folio checkpoint, a Hugging Face GPT-2 directory or a "
                           "nanoGPT ckpt.pt")
    try:
        folio = json.loads((src / HF_CONFIG_FILE).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        folio = False
    if not folio:
        return read_hf(src, bpe_dir=bpe_dir)
    try:
        ckpt = load_checkpoint(src)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    if ckpt.meta.get("quantization", "none") != "none":
        raise ConvertError(f"{src} holds {ckpt.meta['quantization']} weights; start from its float checkpoint")
    return ckpt.model, ckpt.tokenizer, {"source": str(src.resolve()), "source_sha256": ckpt.meta.get("weights_sha256")}


# --- shared -------------------------------------------------------------------------------------------------


def _build_model(config: GPTConfig, state: dict[str, torch.Tensor], source: str) -> GPT:
    """A `GPT` holding exactly `state`, checked name by name and shape by shape; the LM head stays tied."""
    wte = state.get("transformer.wte.weight")
    head = state.pop("lm_head.weight", None)
    if head is not None and wte is not None and not torch.equal(head, wte):
        raise ConvertError(f"{source}: lm_head.weight differs from transformer.wte.weight; Folio ties them")
    with torch.device("meta"):
        model = GPT(config)
    expected = {k: v.shape for k, v in model.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConvertError(
            f"{source} does not match a GPT-2 of its config: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    for k, shape in expected.items():
        if state[k].shape != shape:
            raise ConvertError(
                f"{source}: tensor {k} has shape {tuple(state[k].shape)} (after conversion), "
                f"the config needs {tuple(shape)}"
            )
    state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.lm_head.weight = model.transformer.wte.weight  # re-tie after assign
    return model.eval()


def _gpt2_bpe(bpe_dir: str | os.PathLike[str] | None) -> BPETokenizer:
    try:
        return gpt2_tokenizer(bpe_dir)
    except TokenizerError as e:
        raise ConvertError(f"cannot build GPT-2's BPE tokenizer: {e}") from None


def _refuse_same_dir(src: Path, out: Path) -> None:
    if out.exists() and src.exists() and out.resolve() == src.resolve():
        raise ConvertError(f"OUT_DIR {out} is the source directory; writing there would overwrite its config.json")


def _save(out: Path, model: GPT, tokenizer: CharTokenizer | BPETokenizer, training: dict[str, Any]) -> Path:
    try:
        return save_checkpoint(out, model, tokenizer, training=training)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None


# --- CLI ----------------------------------------------------------------------------------------------------


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m model.convert", description="Convert GPT-2 weights into a Folio checkpoint."
    )
    sub = p.add_subparsers(dest="source", required=True)
    hf = sub.add_parser("hf", help="a Hugging Face GPT-2 directory (config.json + model.safetensors)")
    hf.add_argument("src_dir", help="directory written by GPT2LMHeadModel.save_pretrained")
    hf.add_argument("out_dir", help="where to write the Folio checkpoint")
    nano = sub.add_parser("nanogpt", help="a nanoGPT ckpt.pt (+ meta.pkl for a character-level model)")
    nano.add_argument("ckpt", help="nanoGPT's ckpt.pt")
    nano.add_argument("out_dir", help="where to write the Folio checkpoint")
    nano.add_argument("--meta", default=None, help="nanoGPT's meta.pkl (character vocabulary); default: GPT-2 BPE")
    for sp in (hf, nano):
        sp.add_argument(
            "--bpe-dir",
            default=None,
            help="folder with GPT-2's vocab.bpe and encoder.json (default: $FOLIO_GPT2_BPE_DIR, else download)",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.source == "hf":
            out = convert_hf(args.src_dir, args.out_dir, bpe_dir=args.bpe_dir)
        else:
            out = convert_nanogpt(args.ckpt, args.out_dir, meta_path=args.meta, bpe_dir=args.bpe_dir)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote Folio checkpoint {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
