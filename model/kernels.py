"""CPU kernels for decoding: `linear` for a few rows at memory bandwidth, and one-token attention in one call.

Decoding one token reads every weight once and does two flops per weight, so on a CPU a decode step is bound
by memory bandwidth. PyTorch's fp32 `linear` for one row (MKL's GEMV) reads the weights at about half the
bandwidth this machine measures (13-16 of ~30 GB/s on the 2-core AVX2 VM), and for 2-64 rows MKL's GEMM is
slower still. The kernels here stream each weight row once for all (up to `MAX_ROWS`) input rows. Below
`PACKED_MIN_ROWS` rows, dot products: tiles of 4 weight rows x 3 input rows in AVX2 registers (8 weight rows for
one input row), reading at 23-30 GB/s. From there on, when the weight has a packed copy (`pack_weights`, which
the engine makes at start: panels of 16 outputs), a tile of 6 input rows x 16 outputs accumulates outer products
with no reductions: 150-190 GFLOP/s of this machine's 199 peak at 16-64 rows, where the dot products reach
120-150 and MKL 55-95. All of it runs on the kernels' own spinning thread pool (sized by `torch.set_num_threads`;
see `Pool` in the source for why not OpenMP's).
`decode_attention` does a decode step's attention (cache write, scores, softmax, weighted sum) for every row
and head in one call, where torch needs a dozen small ops per layer, and `decode_block` a whole transformer block
of a decode step (layer norms, the four products, attention, GELU, residuals) in one call from Python: a step
of GPT-2 small then makes ~15 calls instead of ~150, which mattered more than any kernel for small models.
torch's element-wise ops inside run on the calling thread alone (an OpenMP team of theirs would compete with the
pool's workers for the cores); `serial_torch_ops()` does the same for a whole decode step.

`linear(x, weight, bias)` uses the kernel for fp32 CPU inputs with at most `MAX_ROWS` rows and no autograd,
once `load()` has built it; anything else goes to `F.linear`. Results equal torch's up to float summation
order (tests/model/test_kernels.py). The C++ source is compiled once with `torch.utils.cpp_extension` (g++ and
ninja) into `FOLIO_KERNEL_DIR` (default ~/.cache/folio/kernels), keyed by a hash of the source, flags and
torch's version; later processes import the built library without a compiler (the Docker image ships it
prebuilt: `python -m model.kernels`). Where it cannot be built (no compiler, no AVX2, FOLIO_CPU_KERNELS=0)
`load()` logs why and torch's ops serve: slower, same results.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch.nn import functional as F

log = logging.getLogger(__name__)

# Up to here the kernel beats MKL on this machine (fp32 GFLOP/s, 2 threads; M=1 reads ~2x faster, M=8 2.4-3x,
# M=32 1.1-2.3x, M=64 1.2-1.5x); from M=128 MKL's blocked GEMM wins except for the LM head. A prompt goes to MKL.
MAX_ROWS = 64
# from this many rows a weight's packed copy (`pack_weights`) is used: below, the dot products are as fast
PACKED_MIN_ROWS = 4
# a cached forward of up to this many tokens (rows x chunk) goes through `decode_block`, each token a row: where
# the kernels do its products (a prompt of 8 tokens of GPT-2: 26 ms where torch's ops take 60; from 200 tokens on
# torch's path is ~7% faster)
FUSED_MAX_TOKENS = MAX_ROWS

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <thread>
#include <vector>

// OpenMP's thread count is per thread (an ICV); libgomp is loaded with torch (see set_torch_threads)
extern "C" void omp_set_num_threads(int);

// The kernels' own thread pool. OpenMP's would do, but when two threads of a process each own an OpenMP team
// (the server's event loop loaded the model, the engine thread decodes) libgomp counts more threads than CPUs
// and stops spinning between parallel regions: every kernel call then waits tens of microseconds for its
// workers to wake, and a decode step makes ~60 calls. These workers spin for up to 200 us after a job (the
// Python between two kernels of a step), then sleep until the next one.
class Pool {
 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)) {
    for (int w = 1; w < threads_; w++) std::thread([this, w] { work(w); }).detach();
  }
  int threads() const { return threads_; }

  // fn(begin, end) over [0, n), in chunks of at least `grain` that up to `threads` threads take in turn from a
  // counter; inline when n <= grain. Fixed equal pieces left one thread waiting on the other ~11% of a batch-1
  // GPT-2 step (the VM's threads do not run at the same speed); now the one that finishes first takes more.
  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    if (threads_ == 1 || n <= grain) { fn(0, n); return; }
    std::lock_guard<std::mutex> one_job(run_mutex_);
    const int64_t pieces = std::min<int64_t>(threads_, (n + grain - 1) / grain);
    job_ = &fn; n_ = n; pieces_ = pieces;
    chunk_ = std::max<int64_t>(grain, (n + 8 * pieces - 1) / (8 * pieces));
    next_.store(0, std::memory_order_relaxed);
    // every worker acknowledges every job, with a piece or without: none can lag into the next job's fields
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    take();
    // waiting on a worker: after a short spin, yield this core, which the worker may be waiting for (in a server
    // the event loop's thread and the client share the cores; with nothing else runnable, yield returns at once)
    for (int spins = 0; pending_.load(std::memory_order_acquire) > 0; spins++) {
      if (spins < 1024) _mm_pause(); else sched_yield();
    }
  }

 private:
  void take() {
    for (int64_t begin; (begin = next_.fetch_add(chunk_, std::memory_order_relaxed)) < n_;)
      (*job_)(begin, std::min(n_, begin + chunk_));
  }
  void work(int w) {
    at::get_num_threads();  // torch's per-thread setup now, so that it cannot undo the next line later
    omp_set_num_threads(1);  // torch ops a job calls (GELU's slices) stay on this worker
    uint64_t seen = 0;  // the epoch at construction (not a load: the first job may be published before this runs)
    while (true) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (epoch_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          wake_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (w < pieces_) take();
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
  const int threads_;
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> pending_{0};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0, pieces_ = 1, chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

static constexpr int64_t MAX_ROWS = @MAX_ROWS@;  // kernels.MAX_ROWS

// A forked child has none of its parent's worker threads: it makes a pool of its own at its first call.
static std::atomic<bool> forked{false};
static void after_fork_in_child() { forked.store(true); }

static Pool& pool() {
  static Pool* p = [] {
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
    return new Pool(at::get_num_threads());  // sized by torch.set_num_threads at first use; never freed
  }();
  if (forked.exchange(false)) p = new Pool(at::get_num_threads());  // the parent's pool is left as it was
  return *p;
}

int64_t pool_threads() { return pool().threads(); }

// The calling thread's OpenMP thread count for torch's ops (OpenMP's count is per thread); returns the previous
// one. The pool is made first if it was not yet: it takes its size from torch's count as it was. at::get_num_threads
// before setting: torch sets a thread's count at its first parallel op, which would otherwise undo this one.
int64_t set_torch_threads(int64_t n) {
  pool();
  const int64_t previous = at::get_num_threads();
  omp_set_num_threads(static_cast<int>(n));
  return previous;
}

// torch's ops called from this thread within a scope run on it alone (set_torch_threads(1), then back)
struct OneOpenMPThread {
  explicit OneOpenMPThread(bool on) : saved_(on ? set_torch_threads(1) : 0) {}
  ~OneOpenMPThread() { if (saved_) set_torch_threads(saved_); }
  OneOpenMPThread(const OneOpenMPThread&) = delete;
  OneOpenMPThread& operator=(const OneOpenMPThread&) = delete;
 private:
  const int64_t saved_;
};

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// y[m, o + r] = sum_i x[m, i] * w[o + r, i] (+ b[o + r]) for r < R, m < MB; I % 8 == 0
template <int R, int MB>
static inline void tile(const float* w, const float* x, float* y, const float* b, int64_t I, int64_t O) {
  __m256 acc[R][MB];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < I; i += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; m++) xv[m] = _mm256_loadu_ps(x + m * I + i);
    for (int r = 0; r < R; r++) {
      __m256 wv = _mm256_loadu_ps(w + r * I + i);
      for (int m = 0; m < MB; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) y[m * O + r] = hsum(acc[r][m]) + (b ? b[r] : 0.f);
}

// rows o..o+R-1 of w for all M inputs, three at a time (12 accumulators: enough independent FMAs in flight)
template <int R>
static inline void rows(const float* w, const float* x, float* y, const float* b, int64_t I, int64_t O, int64_t M) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<R, 3>(w, x + m * I, y + m * O, b, I, O);
  if (M - m == 2) tile<R, 2>(w, x + m * I, y + m * O, b, I, O);
  if (M - m == 1) tile<R, 1>(w, x + m * I, y + m * O, b, I, O);
}

template <int R>
static inline void one_row(const float* w, const float* x, float* y, const float* b, int64_t I) {
  tile<R, 1>(w, x, y, b, I, 0);
}

// the bias's data (nullptr without one), checked against O outputs
static const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t O) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == O && bias->scalar_type() == at::kFloat, "linear: bias");
  return bias->data_ptr<float>();
}

// Tasks per thread for tasks that each read `bytes` of weights and do `flops`: a task is worth a thread when it
// reads >= 512 KiB or does >= 2 MFLOP (waking a sleeping thread costs tens of microseconds, more than the whole
// product for the small layers of a small model)
static int64_t grain_for(int64_t bytes, int64_t flops) {
  return std::max<int64_t>(1, std::min((int64_t(512) << 10) / bytes, int64_t(2000000) / flops));
}

// x (M, I), w (O, I), b (O) or none -> (M, O); fp32, contiguous, I % 8 == 0
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: shapes");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == at::kFloat
              && w.scalar_type() == at::kFloat && w.size(1) % 8 == 0, "linear: fp32 contiguous, in % 8 == 0");
  const int64_t M = x.size(0), I = w.size(1), O = w.size(0);
  auto y = torch::empty({M, O}, x.options());
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias_data(bias, O);
  auto grain = [&](int64_t rows_per_block) { return grain_for(rows_per_block * I * 4, 2 * rows_per_block * I * M); };
  if (M == 1) {  // decoding one row: 8 weight rows per tile (more streams in flight reads closer to bandwidth)
    const int64_t blocks = (O + 7) / 8;
    pool().run(blocks, grain(8), [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; blk++) {
        const int64_t o = blk * 8;
        const float* bo = bp ? bp + o : nullptr;
        if (O - o >= 8) {
          one_row<8>(wp + o * I, xp, yp + o, bo, I);
        } else {
          for (int64_t r = o; r < O; r++) one_row<1>(wp + r * I, xp, yp + r, bp ? bp + r : nullptr, I);
        }
      }
    });
    return y;
  }
  const int64_t blocks = (O + 3) / 4;
  pool().run(blocks, grain(4), [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; blk++) {
      const int64_t o = blk * 4;
      const float* bo = bp ? bp + o : nullptr;
      switch (std::min<int64_t>(4, O - o)) {
        case 4: rows<4>(wp + o * I, xp, yp + o, bo, I, O, M); break;
        case 3: rows<3>(wp + o * I, xp, yp + o, bo, I, O, M); break;
        case 2: rows<2>(wp + o * I, xp, yp + o, bo, I, O, M); break;
        default: rows<1>(wp + o * I, xp, yp + o, bo, I, O, M); break;
      }
    }
  });
  return y;
}

// The packed layout for 2-64 rows. The dot products above reduce each output across a vector at the end and
// read every input row once per four weight rows; with the weights packed as panels of 16 outputs,
// wp[panel][i][16], a tile instead keeps 6 input rows x 16 outputs in 12 accumulators, broadcasting one input
// value against two weight vectors, with no reductions: 15-25% more GFLOP/s at 16-64 rows on this machine's Zen 3
// (150-190 of a 199 GFLOP/s peak); from 4 rows on, where it is clearly faster.
static constexpr int64_t PANEL = 16;
// below this many rows the dot products are as fast (one row: faster, eight weight rows in flight)
static constexpr int64_t PACKED_MIN_ROWS = @PACKED_MIN_ROWS@;  // kernels.PACKED_MIN_ROWS

// w (O, I) -> (ceil(O / 16), I, 16), the last panel zero-padded
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: a 2-D fp32 weight");
  w = w.contiguous();
  const int64_t O = w.size(0), I = w.size(1), P = (O + PANEL - 1) / PANEL;
  auto out = torch::zeros({P, I, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++)
      for (int64_t r = 0; r < PANEL && p * PANEL + r < O; r++)
        for (int64_t i = 0; i < I; i++) dst[(p * I + i) * PANEL + r] = src[(p * PANEL + r) * I + i];
  });
  return out;
}

// y[m, 0..15] = x[m] . panel (+ b) for MR <= 6 input rows, written to y (row stride ys)
template <int MR>
static inline void panel_tile(const float* __restrict wp, const float* __restrict x, float* __restrict y,
                              const float* b, int64_t I, int64_t ys) {
  // named accumulators, not an array: g++ keeps an array of vectors in memory across the loop
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  // input row r's value times both weight vectors, into row r's two accumulators
#define FOLIO_PANEL_ROW(r)                            \
  v = _mm256_broadcast_ss(x + (r) * I + i);           \
  a##r##0 = _mm256_fmadd_ps(w0, v, a##r##0);          \
  a##r##1 = _mm256_fmadd_ps(w1, v, a##r##1);
  for (int64_t i = 0; i < I; i++) {
    const __m256 w0 = _mm256_loadu_ps(wp + i * PANEL), w1 = _mm256_loadu_ps(wp + i * PANEL + 8);
    __m256 v;
    FOLIO_PANEL_ROW(0)
    if constexpr (MR > 1) { FOLIO_PANEL_ROW(1) }
    if constexpr (MR > 2) { FOLIO_PANEL_ROW(2) }
    if constexpr (MR > 3) { FOLIO_PANEL_ROW(3) }
    if constexpr (MR > 4) { FOLIO_PANEL_ROW(4) }
    if constexpr (MR > 5) { FOLIO_PANEL_ROW(5) }
  }
#undef FOLIO_PANEL_ROW
  const __m256 zero = _mm256_setzero_ps(), b0 = b ? _mm256_loadu_ps(b) : zero, b1 = b ? _mm256_loadu_ps(b + 8) : zero;
  const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int m = 0; m < MR; m++) {
    _mm256_storeu_ps(y + m * ys, _mm256_add_ps(acc[m][0], b0));
    _mm256_storeu_ps(y + m * ys + 8, _mm256_add_ps(acc[m][1], b1));
  }
}

// every input row against one panel, six rows at a time
static inline void panel_rows(const float* wp, const float* x, float* y, const float* b, int64_t I, int64_t ys,
                              int64_t M) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) panel_tile<6>(wp, x + m * I, y + m * ys, b, I, ys);
  switch (M - m) {
    case 5: panel_tile<5>(wp, x + m * I, y + m * ys, b, I, ys); break;
    case 4: panel_tile<4>(wp, x + m * I, y + m * ys, b, I, ys); break;
    case 3: panel_tile<3>(wp, x + m * I, y + m * ys, b, I, ys); break;
    case 2: panel_tile<2>(wp, x + m * I, y + m * ys, b, I, ys); break;
    case 1: panel_tile<1>(wp, x + m * I, y + m * ys, b, I, ys); break;
    default: break;
  }
}

// x (M, I) against a packed weight (P, I, 16) holding `O` outputs, + b -> (M, O)
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(1) == x.size(1) && wp.size(2) == PANEL
              && wp.size(0) == (O + PANEL - 1) / PANEL && x.is_contiguous() && wp.is_contiguous()
              && x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat, "packed linear: shapes");
  const int64_t M = x.size(0), I = x.size(1), P = wp.size(0);
  auto y = torch::empty({M, O}, x.options());
  const float* wpp = wp.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias_data(bias, O);
  const int64_t grain = grain_for(PANEL * I * 4, 2 * PANEL * I * M);  // a panel's work
  pool().run(P, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const int64_t o = p * PANEL;
      if (o + PANEL <= O) {
        panel_rows(wpp + p * I * PANEL, xp, yp + o, bp ? bp + o : nullptr, I, O, M);
        continue;
      }
      // the last, partial panel: into a buffer, then the outputs that exist
      float b16[PANEL] = {0};
      if (bp) std::memcpy(b16, bp + o, (O - o) * sizeof(float));
      std::vector<float> buf(M * PANEL);
      panel_rows(wpp + p * I * PANEL, xp, buf.data(), b16, I, PANEL, M);
      for (int64_t m = 0; m < M; m++) std::memcpy(yp + m * O + o, buf.data() + m * PANEL, (O - o) * sizeof(float));
    }
  });
  return y;
}

static inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum(acc);
}

// (sum a, sum b, sum c, sum d) of four vectors of eight
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// q . k[r] for the four rows k[0..3] (row stride n, n % 8 == 0): four independent chains, not one
static inline __m128 dot4(const float* q, const float* k, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + n + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * n + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * n + i), a3);
  }
  return hsum4(a0, a1, a2, a3);
}

// out[0..8NV) = scale * sum_j s[j] v[j][0..8NV) over j < n (row stride hs): NV independent accumulators
template <int NV>
static inline void weighted_sum(const float* s, const float* v, int64_t n, int64_t hs, float* out, float scale) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t j = 0; j < n; j++) {
    const __m256 w = _mm256_set1_ps(s[j]);
    const float* r = v + j * hs;
    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
    if constexpr (NV > 1) a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
    if constexpr (NV > 2) a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
    if constexpr (NV > 3) a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
    if constexpr (NV > 4) a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 32), a4);
    if constexpr (NV > 5) a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 40), a5);
    if constexpr (NV > 6) a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 48), a6);
    if constexpr (NV > 7) a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 56), a7);
  }
  const __m256 f = _mm256_set1_ps(scale);
  const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  for (int k = 0; k < NV; k++) _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(acc[k], f));
}

// Attention for B new tokens at once, every (token, head): qkv (B, 3C) holds each token's query, key and value.
// First every token's key and value go to cache slot pos[b] of cache row rows[b] (k_cache, v_cache:
// (rows, n_head, max_len, hs)); then each query attends to slots 0..pos[b] of its row. A decode step has one
// token per row; a prompt chunk several, which see each other's keys causally through their positions. -> (B, C)
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor rows, torch::Tensor pos, int64_t n_head) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "attention: qkv");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous()
              && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat, "attention: cache");
  const int64_t B = qkv.size(0), C = qkv.size(1) / 3, hs = C / n_head;
  const int64_t L = k_cache.size(2);
  TORCH_CHECK(k_cache.size(1) == n_head && k_cache.size(3) == hs && hs % 8 == 0, "attention: head size");
  auto rows_c = rows.to(at::kLong).contiguous();
  auto pos_c = pos.to(at::kLong).contiguous();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  const int64_t* pp = pos_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK(rp[b] >= 0 && rp[b] < k_cache.size(0) && pp[b] >= 0 && pp[b] < L, "attention: row or position");
  auto y = torch::empty({B, C}, qkv.options());
  const float* qp = qkv.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  int64_t longest = 0;
  for (int64_t b = 0; b < B; b++) longest = std::max(longest, pp[b] + 1);
  // about 4 flops per cached value read; a thread for every >= 1 MFLOP (see linear's grain)
  const int64_t grain = std::max<int64_t>(1, 250000 / (longest * hs));
  // the writes before any read: a token of a chunk may read the key of one before it in another thread's task
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < n_head; h++) {
      const int64_t slot = ((rp[b] * n_head + h) * L + pp[b]) * hs;
      std::memcpy(kc + slot, qp + b * 3 * C + C + h * hs, hs * sizeof(float));
      std::memcpy(vc + slot, qp + b * 3 * C + 2 * C + h * hs, hs * sizeof(float));
    }
  pool().run(B * n_head, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s(L);
    for (int64_t bh = begin; bh < end; bh++) {
      const int64_t b = bh / n_head, h = bh % n_head, p = pp[b];
      const float* q = qp + b * 3 * C + h * hs;
      const float* kr = kc + (rp[b] * n_head + h) * L * hs;  // this row and head: (L, hs)
      const float* vr = vc + (rp[b] * n_head + h) * L * hs;
      // scores four keys at a time (a single dot product per key waits on its own chain of FMAs)
      int64_t j = 0;
      for (; j + 4 <= p + 1; j += 4)
        _mm_storeu_ps(s.data() + j, _mm_mul_ps(dot4(q, kr + j * hs, hs), _mm_set1_ps(scale)));
      for (; j <= p; j++) s[j] = dot(q, kr + j * hs, hs) * scale;
      float mx = -INFINITY;
      for (j = 0; j <= p; j++) mx = std::max(mx, s[j]);
      float sum = 0.f;
      for (j = 0; j <= p; j++) {
        s[j] = std::exp(s[j] - mx);
        sum += s[j];
      }
      // the weighted sum of the values, up to 64 dimensions at a time in registers
      float* out = yp + b * C + h * hs;
      for (int64_t d = 0; d < hs; d += 64) {
        const float* v = vr + d;
        switch (std::min<int64_t>(8, (hs - d) / 8)) {
          case 8: weighted_sum<8>(s.data(), v, p + 1, hs, out + d, 1.f / sum); break;
          case 7: weighted_sum<7>(s.data(), v, p + 1, hs, out + d, 1.f / sum); break;
          case 6: weighted_sum<6>(s.data(), v, p + 1, hs, out + d, 1.f / sum); break;
          case 5: weighted_sum<5>(s.data(), v, p + 1, hs, out + d, 1.f / sum); break;
          case 4: weighted_sum<4>(s.data(), v, p + 1, hs, out + d, 1.f / sum); break;
          case 3: weighted_sum<3>(s.data(), v, p + 1, hs, out + d, 1.f / sum); break;
          case 2: weighted_sum<2>(s.data(), v, p + 1, hs, out + d, 1.f / sum); break;
          default: weighted_sum<1>(s.data(), v, p + 1, hs, out + d, 1.f / sum); break;
        }
      }
    }
  });
  return y;
}

// x (M, I) @ w.T + b: PACKED_MIN_ROWS..MAX_ROWS rows go to the packed kernel when the weight has a packed copy, else to
// the dot products when I % 8 == 0; torch's linear otherwise (the one place that rule lives: `kernels.linear`
// calls this too)
static torch::Tensor lin(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b,
                         const c10::optional<torch::Tensor>& packed) {
  const int64_t M = x.size(0);
  if (M >= PACKED_MIN_ROWS && M <= MAX_ROWS && packed.has_value()) return packed_linear(x, *packed, b, w.size(0));
  if (M <= MAX_ROWS && w.size(1) % 8 == 0) return small_linear(x, w, b);
  return at::linear(x, w, b);
}

// One transformer block for B new tokens (a decode step's one per row, or prompt chunks), in one call: what
// Block.forward computes on the cached path, without a Python round trip per op. x (B, C) -> (B, C).
torch::Tensor decode_block(torch::Tensor x, torch::Tensor ln1_w, c10::optional<torch::Tensor> ln1_b,
                           torch::Tensor attn_w, c10::optional<torch::Tensor> attn_b, torch::Tensor proj_w,
                           c10::optional<torch::Tensor> proj_b, torch::Tensor ln2_w,
                           c10::optional<torch::Tensor> ln2_b, torch::Tensor fc_w, c10::optional<torch::Tensor> fc_b,
                           torch::Tensor fc2_w, c10::optional<torch::Tensor> fc2_b, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor rows, torch::Tensor pos, int64_t n_head,
                           std::vector<c10::optional<torch::Tensor>> packed) {
  TORCH_CHECK(packed.size() == 4, "decode_block: a packed weight (or None) for each of the four products");
  const int64_t B = x.size(0), C = x.size(1);
  // torch's element-wise ops here (layer norms, GELU, residual adds) run on this thread alone: an OpenMP team
  // of their own would compete for the cores with this pool's workers, which spin between the products (on two
  // cores that doubled a 32-row GPT-2 step). With more rows than the kernels take, torch's GEMM needs the team.
  OneOpenMPThread serial(B <= MAX_ROWS);
  auto h = at::layer_norm(x, {C}, ln1_w, ln1_b, 1e-5);
  auto y = decode_attention(lin(h, attn_w, attn_b, packed[0]), k_cache, v_cache, rows, pos, n_head);
  x = x + lin(y, proj_w, proj_b, packed[1]);
  h = lin(at::layer_norm(x, {C}, ln2_w, ln2_b, 1e-5), fc_w, fc_b, packed[2]);
  // GELU (torch's vectorised tanh, in place) split by rows over the pool: for 32 rows of GPT-2, 0.5 ms alone
  const int64_t width = h.size(1);
  pool().run(B, std::max<int64_t>(1, 65536 / width), [&](int64_t begin, int64_t end) {
    c10::InferenceMode inference;  // h may be an inference tensor; a worker thread starts outside inference mode
    auto part = h.narrow(0, begin, end - begin);
    at::gelu_(part, "tanh");
  });
  return x + lin(h, fc2_w, fc2_b, packed[3]);
}

// the GIL is released while a kernel runs, so other Python threads (the server's event loop) run meanwhile
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_block", &decode_block, py::call_guard<py::gil_scoped_release>());
  m.def("linear", &lin, py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>());
  m.def("pack", &pack, py::call_guard<py::gil_scoped_release>());
  m.def("pool_threads", &pool_threads);
  m.def("set_torch_threads", &set_torch_threads);
}
"""

_CFLAGS = ["-O3", "-mavx2", "-mfma"]

_SOURCE = _SOURCE.replace("@MAX_ROWS@", str(MAX_ROWS)).replace("@PACKED_MIN_ROWS@", str(PACKED_MIN_ROWS))

_lock = threading.Lock()
_ext: ModuleType | None = None
_why_not: str | None = None


def _name() -> str:
    key = _SOURCE + " ".join(_CFLAGS) + torch.__version__ + platform.machine()
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"folio_kernels_{digest}"


def _directory() -> Path:
    default = Path.home() / ".cache" / "folio" / "kernels"
    return Path(os.environ.get("FOLIO_KERNEL_DIR") or default) / _name()


def _import_built(directory: Path, name: str) -> ModuleType | None:
    """The library a previous `load()` built, without invoking the compiler (or needing one)."""
    built = directory / f"{name}.so"
    if not built.is_file():
        return None
    loader = importlib.machinery.ExtensionFileLoader(name, str(built))
    spec = importlib.util.spec_from_file_location(name, built, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load() -> bool:
    """Build (once per source and torch version) and load the kernel; True when `linear` will use it."""
    global _ext, _why_not
    with _lock:
        if _ext is not None or _why_not is not None:
            return _ext is not None
        if os.environ.get("FOLIO_CPU_KERNELS", "1") == "0":
            _why_not = "turned off (FOLIO_CPU_KERNELS=0)"
        elif platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() not in (
            "AVX2", "AVX512"):
            _why_not = f"needs an x86-64 CPU with AVX2 (this one: {platform.machine()}, "
            _why_not += f"{torch.backends.cpu.get_cpu_capability()})"
        else:
            name, directory = _name(), _directory()
            try:
                _ext = _import_built(directory, name)
                if _ext is None:
                    from torch.utils.cpp_extension import load_inline

                    directory.mkdir(parents=True, exist_ok=True)
                    log.info("building the CPU decode kernel once into %s (about a minute)", directory)
                    _ext = load_inline(name, cpp_sources=_SOURCE, build_directory=str(directory),
                                       extra_cflags=_CFLAGS, verbose=False)
            except Exception as e:  # no compiler, no ninja, a read-only cache: serve with F.linear
                _why_not = f"could not be built: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        if _why_not is not None:
            log.warning("CPU decode kernel %s; using torch's linear (slower on CPU, same results)", _why_not)
        return _ext is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, `linear` and the model use torch's own ops (references, benchmarks)."""
    global _ext
    saved, _ext = _ext, None
    try:
        yield
    finally:
        _ext = saved


@contextlib.contextmanager
def serial_torch_ops() -> Iterator[None]:
    """Within the block, torch's own ops called from this thread run on it alone (OpenMP's per-thread count),
    while the kernels still use their pool. For decode steps: an OpenMP team would spin on the cores after each
    small op (layer norm, embedding, log-softmax) and compete with the kernels' workers. Other threads are
    unaffected; a no-op without the kernels."""
    ext = _ext
    if ext is None:
        yield
        return
    previous = ext.set_torch_threads(1)
    try:
        yield
    finally:
        ext.set_torch_threads(previous)


def status() -> str:
    """'loaded', 'not loaded' or why it cannot be used (for /info and logs)."""
    return "loaded" if _ext is not None else (_why_not or "not loaded")


def decode_block_applies(activations: torch.Tensor, cache: torch.Tensor, head_size: int) -> bool:
    """Whether `decode_block` can serve this one-token step (fp32 on CPU, head size a multiple of 8)."""
    return (
        _ext is not None
        and activations.device.type == "cpu"
        and activations.dtype == torch.float32
        and cache.dtype == torch.float32
        and head_size % 8 == 0
        and not torch.is_grad_enabled()
    )


def pack_weights(model: torch.nn.Module) -> int:
    """Give every fp32 CPU `nn.Linear` weight of `model` a packed copy (panels of 16 outputs) that `linear` and
    `decode_block` then use for up to `MAX_ROWS` rows: 15-25% faster at 16-64 rows than the dot products. The
    copy costs as much memory again as those weights. A copy is used only while its weight is unchanged (an
    in-place update bumps the weight's version; the kernel then reads the weight itself). The bytes packed."""
    if _ext is None:
        return 0
    total = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if (isinstance(module, torch.nn.Linear) and w is not None and w.device.type == "cpu"
                and w.dtype == torch.float32 and w.dim() == 2):
            with torch.no_grad():
                w._folio_packed = (_version(w), _ext.pack(w.detach()))
            total += w._folio_packed[1].numel() * 4
    return total


def _version(weight: torch.Tensor) -> int:
    # an inference tensor has no version counter (and can only change within inference mode)
    return -1 if weight.is_inference() else weight._version


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of `weight` from `pack_weights`, if it has one that is still current."""
    packed = getattr(weight, "_folio_packed", None)
    return packed[1] if packed is not None and packed[0] == _version(weight) else None


def decode_block(x: torch.Tensor, block: torch.nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rows: torch.Tensor, pos: torch.Tensor, n_head: int) -> torch.Tensor:
    """`Block.forward` for B new tokens in one call: x (B, C), token b at position `pos[b]` of cache row `rows[b]`
    (this layer's caches; several tokens of one row attend causally by position) -> (B, C). The block's
    parameters are read by their GPT-2 names."""
    assert _ext is not None
    attn, mlp = block.attn, block.mlp
    return _ext.decode_block(
        x.contiguous(), block.ln_1.weight, block.ln_1.bias, attn.c_attn.weight, attn.c_attn.bias,
        attn.c_proj.weight, attn.c_proj.bias, block.ln_2.weight, block.ln_2.bias, mlp.c_fc.weight, mlp.c_fc.bias,
        mlp.c_proj.weight, mlp.c_proj.bias, k_cache, v_cache, rows, pos, n_head,
        [_packed(w) for w in (attn.c_attn.weight, attn.c_proj.weight, mlp.c_fc.weight, mlp.c_proj.weight)])


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     pos: torch.Tensor, n_head: int) -> torch.Tensor:
    """One-token attention for B rows: qkv (B, 3C) -> (B, C). Writes each row's key and value to slot `pos[b]`
    of cache row `rows[b]` (caches: (rows, n_head, max_len, head_size)), then attends to slots 0..pos[b] —
    what the cached path of `CausalSelfAttention` computes with index_put, a mask and SDPA, in one call."""
    assert _ext is not None
    return _ext.decode_attention(qkv.contiguous(), k_cache, v_cache, rows, pos, n_head)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the kernel when it applies (see the module docstring)."""
    ext = _ext
    if (ext is None or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32):
        return F.linear(x, weight, bias)
    *lead, n_in = x.shape
    # the extension picks (`lin`): its kernels for <= MAX_ROWS rows, else torch's linear
    y = ext.linear(x.reshape(-1, n_in).contiguous(), weight.contiguous(), bias, _packed(weight))
    return y.view(*lead, weight.shape[0])


if __name__ == "__main__":  # python -m model.kernels: build now (the Docker image does this at build time)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = load()
    print(f"CPU decode kernels: {status()} ({_directory()})")
    raise SystemExit(0 if ok else 1)
