// The kernels' own thread pool, and the calling thread's share of torch's OpenMP threads.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

// OpenMP's thread count is per thread (an ICV); libgomp is loaded with torch (see set_torch_threads)
extern "C" void omp_set_num_threads(int);

namespace folio {

// The calling thread's cap on how many of the pool's threads its jobs use (its engine's thread count, set by
// use_threads); 0: all. Thread-local: two engines in one process (two models) each keep their own.
inline thread_local int pool_limit = 0;

// OpenMP's pool would do, but when two threads of a process each own an OpenMP team (the server's event loop
// loaded the model, the engine thread decodes) libgomp counts more threads than CPUs and stops spinning between
// parallel regions: every kernel call then waits tens of microseconds for its workers to wake, and a decode
// step makes ~60 calls. These workers spin for up to 200 us after a job (the Python between two kernels
// of a step), then sleep until the next one.
class Pool {
 public:
  explicit Pool(int threads) { grow(threads); }
  int threads() const { return threads_; }

  // at least n threads from now on (workers are added, never removed)
  void grow(int n) {
    std::lock_guard<std::mutex> one_job(run_mutex_);  // no job in flight: a new worker waits for the next one
    for (; threads_ < n; threads_++) {
      const uint64_t now = epoch_.load(std::memory_order_acquire);
      if (threads_ > 0) std::thread([this, w = threads_, now] { work(w, now); }).detach();
    }
    threads_ = std::max(threads_, 1);
  }

  // fn(begin, end) over [0, n), in chunks of at least `grain` that up to `threads` threads take in turn from a
  // counter; inline when n <= grain. Not fixed equal pieces: a VM's threads do not run at the same speed (nor
  // do threads sharing cores with a server's event loop), so the one that finishes first takes more.
  // the threads the calling thread's jobs use
  int usable() const { return pool_limit > 0 ? std::min(threads_, pool_limit) : threads_; }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    const int usable = this->usable();
    if (usable == 1 || n <= grain) { fn(0, n); return; }
    std::lock_guard<std::mutex> one_job(run_mutex_);
    const int64_t pieces = std::min<int64_t>(usable, (n + grain - 1) / grain);
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
  void work(int w, uint64_t seen) {  // seen: the epoch when it was added (the next job may come before it runs)
    at::get_num_threads();  // torch's per-thread setup now, so that it cannot undo the next line later
    omp_set_num_threads(1);  // torch ops a job calls (GELU's slices) stay on this worker
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
  int threads_ = 0;
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> pending_{0};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0, pieces_ = 1, chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

// The process's pool (pool.cpp), made at first use with torch's thread count at that moment.
Pool& pool();
int64_t pool_threads();

// Tasks per thread for tasks that each read `bytes` of weights and do `flops`: a task is worth a thread when it
// reads >= 512 KiB or does >= 2 MFLOP (waking a sleeping thread costs tens of microseconds, more than the whole
// product for the small layers of a small model)
inline int64_t grain_for(int64_t bytes, int64_t flops) {
  return std::max<int64_t>(1, std::min((int64_t(512) << 10) / std::max<int64_t>(1, bytes),
                                       int64_t(2000000) / std::max<int64_t>(1, flops)));
}

// The calling thread's jobs use n of the pool's threads (grown to n if it has fewer), and its torch ops n OpenMP
// threads: an engine's thread calls it once with its thread count (pool.cpp).
void use_threads(int64_t n);

// The calling thread's OpenMP thread count for torch's ops; returns the previous one (pool.cpp).
int64_t set_torch_threads(int64_t n);

// torch's ops called from this thread within a scope run on it alone (set_torch_threads(1), then back)
struct OneOpenMPThread {
  explicit OneOpenMPThread(bool on) : saved_(on ? set_torch_threads(1) : 0) {}
  ~OneOpenMPThread() { if (saved_) set_torch_threads(saved_); }
  OneOpenMPThread(const OneOpenMPThread&) = delete;
  OneOpenMPThread& operator=(const OneOpenMPThread&) = delete;

 private:
  const int64_t saved_;
};

}  // namespace folio
