// The Python module: every kernel releases the GIL while it runs, so other Python threads (the server's event
// loop) run meanwhile. TORCH_EXTENSION_NAME is the library's name, set by the build (model/kernels/build.py).
#include <torch/extension.h>

#include "ops.h"
#include "pool.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  py::class_<folio::Stack>(m, "Stack", py::module_local())  // each variant's library its own type
      .def(py::init<const std::vector<std::vector<folio::OptionalTensor>>&, int64_t>())
      .def("forward", &folio::Stack::forward, py::arg("x"), py::arg("k_cache"), py::arg("v_cache"), py::arg("rows"),
           py::arg("pos"), py::arg("lora") = std::vector<folio::LoraGroup>{}, release_gil());
  m.def("linear", &folio::linear, release_gil());
  m.def("bf16_gemm", &folio::bf16_gemm);
  m.def("int8_gemm", &folio::int8_gemm);
  m.def("vnni_gemm", &folio::vnni_gemm);
  m.def("amx_gemm", &folio::amx_gemm);
  m.def("set_amx_min_rows", &folio::set_amx_min_rows);
  m.def("rows_rounded_to", &folio::rows_rounded_to);
  m.def("decode_attention", &folio::decode_attention, release_gil());
  m.def("row_argmax_logsumexp", &folio::row_argmax_logsumexp, release_gil());
  m.def("sample_rows", &folio::sample_rows, release_gil());
  m.def("fill_disallowed", &folio::fill_disallowed, release_gil());
  m.def("pool_threads", &folio::pool_threads);
  m.def("use_threads", &folio::use_threads);
  m.def("set_torch_threads", &folio::set_torch_threads);
}
