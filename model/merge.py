"""`folio merge BASE ADAPTER OUT`: fold a LoRA adapter (PEFT's format, made by `folio train --lora` or by PEFT for a
GPT-2) into its base model and write a full Folio checkpoint, which computes what the base with the adapter computes.

BASE is anything `folio train --init-from` reads (a Folio checkpoint, a Hugging Face GPT-2 directory, a nanoGPT
ckpt.pt); the checkpoint keeps the base's tokenizer and chat template and records both sources' sha256. An adapter
whose modules or shapes do not fit the base is refused, naming the module and the shapes (exit status 2).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from model.checkpoint import CheckpointError, save_checkpoint
from model.cli import ArgumentParser
from model.convert import ConvertError, read_model
from model.files import sha256_file
from model.lora.adapter import ADAPTER_WEIGHTS_FILE, AdapterError, merge_adapter, read_adapter


def merge(base: str | os.PathLike[str], adapter: str | os.PathLike[str], out: str | os.PathLike[str], *,
          bpe_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write the checkpoint of `base` with `adapter` folded in to `out`."""
    model, tokenizer, source = read_model(base, bpe_dir=bpe_dir)
    lora = read_adapter(adapter)
    merge_adapter(model, lora)
    training = {"merged_from": {"base": source, "adapter": str(Path(adapter).resolve()),
                                "adapter_sha256": sha256_file(Path(adapter) / ADAPTER_WEIGHTS_FILE),
                                "r": lora.config.r, "lora_alpha": lora.config.lora_alpha}}
    return save_checkpoint(out, model, tokenizer, training=training)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m model.merge",
                       description="Fold a LoRA adapter into its base model and write a Folio checkpoint.")
    p.add_argument("base", help="the base model: a Folio checkpoint, a Hugging Face GPT-2 directory or nanoGPT ckpt.pt")
    p.add_argument("adapter", help="the adapter directory: adapter_config.json + adapter_model.safetensors")
    p.add_argument("out", help="where to write the merged Folio checkpoint")
    p.add_argument("--bpe-dir", default=None, help="GPT-2's BPE files, for a Hugging Face or nanoGPT base")
    args = p.parse_args(argv)
    try:
        out = merge(args.base, args.adapter, args.out, bpe_dir=args.bpe_dir)
    except (ConvertError, AdapterError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote Folio checkpoint {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
