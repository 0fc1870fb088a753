"""The baseline for bench/server_load.py: the server a user would otherwise write.

A FastAPI endpoint that calls `transformers` `generate` once per request (a plain `def`, so FastAPI runs
it in its thread pool), on the same weights as the Folio checkpoint it is given.

    python -m bench.hf_server --checkpoint DIR --port 8010 [--device cuda]

On a GPU it runs in the dtype Folio's engine uses there (bf16).
"""

from __future__ import annotations

import argparse

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from bench.models import to_hf
from model.checkpoint import load_checkpoint
from model.devices import default_dtype


class Body(BaseModel):
    inputs: str
    parameters: dict = {}


def build(checkpoint: str, device: str = "cpu") -> FastAPI:
    ck = load_checkpoint(checkpoint)
    hf = to_hf(ck.model).to(device, default_dtype(torch.device(device)))
    tok = ck.tokenizer
    app = FastAPI()

    @app.post("/generate")
    def generate(body: Body) -> dict:
        ids = torch.tensor([tok.encode(body.inputs)], device=device)
        n = int(body.parameters.get("max_new_tokens", 20))
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
        return {"generated_text": tok.decode(out[0, ids.shape[1]:].tolist())}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    uvicorn.run(build(args.checkpoint, args.device), host="127.0.0.1", port=args.port, log_level="warning")
