// The process's one kernel pool, remade in a forked child, and the per-thread OpenMP count for torch's ops.
#include "pool.h"

#include <pthread.h>

namespace folio {

// A forked child has none of its parent's worker threads: it makes a pool of its own at its first call.
static std::atomic<bool> forked{false};
static void after_fork_in_child() { forked.store(true); }

Pool& pool() {
  static Pool* p = [] {
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
    return new Pool(at::get_num_threads());  // sized by torch.set_num_threads at first use; never freed
  }();
  if (forked.exchange(false)) p = new Pool(at::get_num_threads());  // the parent's pool is left as it was
  return *p;
}

int64_t pool_threads() { return pool().threads(); }

void use_threads(int64_t n) {
  pool().grow(static_cast<int>(n));
  pool_limit = static_cast<int>(n);
  set_torch_threads(n);
}

// OpenMP's count is per thread. The pool is made first if it was not yet: it takes its size from torch's count as
// it was. at::get_num_threads before setting: torch sets a thread's count at its first parallel op, which would
// otherwise undo this one.
int64_t set_torch_threads(int64_t n) {
  pool();
  const int64_t previous = at::get_num_threads();
  omp_set_num_threads(static_cast<int>(n));
  return previous;
}

}  // namespace folio
