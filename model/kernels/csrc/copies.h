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
  // or was written in place); with `also` (another tensor the copy holds, as int4's scales), where that has changed
  // too. The copies of weights that are gone are dropped when a copy is made. Neither may be an inference tensor
  // (it has no version counter).
  template <typename Make>
  Copy get(const at::Tensor& w, int64_t o, int64_t n, Make make, const at::Tensor* also = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Key key{w.unsafeGetTensorImpl(), o, n};
    auto it = copies_.find(key);
    if (it != copies_.end() && it->second.from.holds(w) && (!also || it->second.also.holds(*also)))
      return it->second.copy;
    for (auto e = copies_.begin(); e != copies_.end();)
      e = e->second.from.gone() ? copies_.erase(e) : std::next(e);
    Copy made = make();
    copies_.insert_or_assign(key, Entry{Source(w), also ? Source(*also) : Source(), made});
    return made;
  }

 private:
  // a tensor a copy was made from, as it was then
  struct Source {
    Source() = default;
    explicit Source(const at::Tensor& t)
        : owner(t.getIntrusivePtr()), data(t.data_ptr()), version(t._version()) {}
    // t is that tensor, its data where they were and not written since
    bool holds(const at::Tensor& t) const {
      return !gone() && owner._unsafe_get_target() == t.unsafeGetTensorImpl() && data == t.data_ptr()
             && version == t._version();
    }
    bool gone() const { return owner.expired(); }
    c10::weak_intrusive_ptr<c10::TensorImpl> owner{c10::intrusive_ptr<c10::TensorImpl>()};  // keeps its address
    const void* data = nullptr;                                                               // from being reused
    int64_t version = 0;
  };
  using Key = std::tuple<const c10::TensorImpl*, int64_t, int64_t>;
  struct Entry {
    Source from, also;
    Copy copy;
  };
  std::mutex mutex_;
  std::map<Key, Entry> copies_;
};

}  // namespace folio
