"""`python -m model.quantize`: write a checkpoint with its weights quantized (int8, bf16 or int4, model/quantize),
to be served as it is; int4 calibrated on text (GPTQ, model/quantize/gptq.py) with `--calibration FILE`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model.checkpoint import load_checkpoint, save_checkpoint
from model.quantize import QUANTIZATIONS, quantize
from model.quantize.calibration import CALIBRATION_TOKENS, quantize_calibrated


def convert(checkpoint: str | Path, out: str | Path, kind: str = "int8", calibration: str | Path | None = None,
            calibration_tokens: int = CALIBRATION_TOKENS, log: bool = False) -> Path:
    """Write `checkpoint` quantized (`kind`) into `out`: a Folio checkpoint whose config.json says
    `"quantization": kind`, loaded as it is (no quantizing at load). With `calibration` (a UTF-8 text file; int4
    only), the 4-bit products are chosen by GPTQ from about `calibration_tokens` tokens of it, and config.json's
    "calibration" says so; `log`: progress on stderr."""
    ck = load_checkpoint(checkpoint)
    if ck.meta.get("quantization", "none") != "none":
        raise ValueError(f"{checkpoint} is already quantized ({ck.meta['quantization']})")
    details = None
    if calibration is None:
        quantize(ck.model, kind)
    elif kind != "int4":
        raise ValueError(f"--calibration (GPTQ) is for --kind int4, got --kind {kind}")
    else:
        details = quantize_calibrated(ck.model, ck.tokenizer.encode, ck.config.block_size,
                                      Path(calibration).read_bytes(), Path(calibration).name, calibration_tokens,
                                      say=(lambda line: print(line, file=sys.stderr, flush=True)) if log else None)
    return save_checkpoint(out, ck.model, ck.tokenizer, training=ck.meta.get("training"), quantization=kind,
                           calibration=details)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a Folio checkpoint directory (fp32)")
    parser.add_argument("--out", required=True, help="the directory to write the quantized checkpoint into")
    parser.add_argument("--kind", default="int8", choices=[q for q in QUANTIZATIONS if q != "none"])
    parser.add_argument("--calibration", type=Path,
                        help="int4: a UTF-8 text like what the model will see (its training text will do); the "
                             "4-bit weights are then chosen by GPTQ instead of rounding to nearest")
    parser.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS,
                        help=f"tokens of --calibration to run (default {CALIBRATION_TOKENS})")
    args = parser.parse_args(argv)
    if args.calibration_tokens < 1:
        parser.error(f"--calibration-tokens must be at least 1, got {args.calibration_tokens}")
    print(f"wrote {convert(args.checkpoint, args.out, args.kind, args.calibration, args.calibration_tokens, log=True)}")


if __name__ == "__main__":
    main()
