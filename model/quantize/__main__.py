"""`python -m model.quantize`: write a checkpoint with its weights quantized (int8, bf16 or int4, model/quantize),
to be served as it is."""

from __future__ import annotations

import argparse
from pathlib import Path

from model.checkpoint import load_checkpoint, save_checkpoint
from model.quantize import QUANTIZATIONS, quantize


def convert(checkpoint: str | Path, out: str | Path, kind: str = "int8") -> Path:
    """Write `checkpoint` quantized (`kind`) into `out`: a Folio checkpoint whose config.json says
    `"quantization": kind`, loaded as it is (no quantizing at load)."""
    ck = load_checkpoint(checkpoint)
    if ck.meta.get("quantization", "none") != "none":
        raise ValueError(f"{checkpoint} is already quantized ({ck.meta['quantization']})")
    quantize(ck.model, kind)
    return save_checkpoint(out, ck.model, ck.tokenizer, training=ck.meta.get("training"), quantization=kind)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a Folio checkpoint directory (fp32)")
    parser.add_argument("--out", required=True, help="the directory to write the quantized checkpoint into")
    parser.add_argument("--kind", default="int8", choices=[q for q in QUANTIZATIONS if q != "none"])
    args = parser.parse_args(argv)
    print(f"wrote {convert(args.checkpoint, args.out, args.kind)}")


if __name__ == "__main__":
    main()
