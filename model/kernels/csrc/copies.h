// Copies the kernels make of a weight at its first use (a GEMM's packed layout) and keep while the weight lives
// unchanged: one cache per kind of copy, keyed by the weight and the rows [o, o + n) copied.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <map>
#include <mutex>
#include <tuple>

namespace folio {

template <typename Copy>
class WeightCopies {
 public:
  // the copy of rows [o, o + n) of w, made by make() where there is none yet or w has changed since (its data moved
  // or was written in place). The copies of weights that are gone are dropped when a copy is made. w must not be an
  // inference tensor (it has no version counter).
  template <typename Make>
  Copy get(const at::Tensor& w, int64_t o, int64_t n, Make make) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Key key{w.unsafeGetTensorImpl(), o, n};
    auto it = copies_.find(key);
    if (it != copies_.end() && !it->second.owner.expired() && it->second.data == w.data_ptr()
        && it->second.version == w._version())
      return it->second.copy;
    for (auto e = copies_.begin(); e != copies_.end();)
      e = e->second.owner.expired() ? copies_.erase(e) : std::next(e);
    Copy made = make();
    copies_.insert_or_assign(key, Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()), w.data_ptr(),
                                        w._version(), made});
    return made;
  }

 private:
  using Key = std::tuple<const c10::TensorImpl*, int64_t, int64_t>;
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> owner;  // keeps the key's address from being reused while held
    const void* data;
    int64_t version;
    Copy copy;
  };
  std::mutex mutex_;
  std::map<Key, Entry> copies_;
};

}  // namespace folio
