// Python bindings of the vendored suffix tree (pybind11: the pip package when installed, else the copy torch ships with its headers,
// so the extension builds wherever torch's C++ extensions build). The surface is arctic-
// inference's ``_C.SuffixTree`` (same names, arguments and results), with two differences:
//
// - ``speculate_ndarray`` / ``speculate`` with ``use_tree_spec=False`` (path drafts, the only
//   kind the index asks for) run ``speculate_longest_first``: the same draft, fewer node visits;
// - ``speculate_handle_ndarray`` is the incremental form (a handle per request; see
//   suffix_tree.cc), with ``forget_handle``, ``num_handles``, ``mutations`` and ``walks``;
// - ``speculate_reference_ndarray`` is arctic's own loop, kept for the tests that prove the two
//   equal and for the benchmark that times both.
//
// Adapted from arctic-inference's csrc/suffix_decoding/bindings.cc (Apache-2.0).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "suffix_tree.h"

namespace py = pybind11;

// C-contiguous int32 only: another dtype is refused (no silent cast), as arctic's binding does.
using Int32Array1D = py::array_t<int32_t, py::array::c_style>;

static std::span<const int32_t> as_span(const Int32Array1D& a) {
    if (a.ndim() != 1) {
        throw py::value_error("expected a 1-D int32 array, got " + std::to_string(a.ndim()) + " dimensions");
    }
    return std::span<const int32_t>(a.data(), static_cast<size_t>(a.shape(0)));
}

static Draft speculate_span(SuffixTree& tree, std::span<const int32_t> context, int max_spec_tokens,
                            float max_spec_factor, float max_spec_offset, float min_token_prob,
                            bool use_tree_spec) {
    if (use_tree_spec) {
        return tree.speculate(context, max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, true);
    }
    return tree.speculate_longest_first(context, max_spec_tokens, max_spec_factor, max_spec_offset,
                                        min_token_prob);
}

PYBIND11_MODULE(_war_suffix_tree, m) {
    m.doc() = "arctic-inference's suffix tree with a longest-first speculate (war-openrlhf)";

    py::class_<Draft>(m, "Draft")
        .def(py::init<>())
        .def_readwrite("token_ids", &Draft::token_ids)
        .def_readwrite("parents", &Draft::parents)
        .def_readwrite("probs", &Draft::probs)
        .def_readwrite("score", &Draft::score)
        .def_readwrite("match_len", &Draft::match_len)
        .def_readwrite("next_len", &Draft::next_len);

    py::class_<SuffixTree>(m, "SuffixTree")
        .def(py::init<int>())
        .def("num_seqs", &SuffixTree::num_seqs)
        .def("remove", &SuffixTree::remove)
        .def("extend",
             [](SuffixTree& t, int seq_id, const std::vector<int32_t>& tokens) {
                 t.extend(seq_id, std::span<const int32_t>(tokens));
             })
        .def("extend_ndarray",
             [](SuffixTree& t, int seq_id, const Int32Array1D& tokens) { t.extend(seq_id, as_span(tokens)); })
        .def("speculate",
             [](SuffixTree& t, const std::vector<int32_t>& context, int k, float factor, float offset,
                float min_prob, bool tree_spec) {
                 return speculate_span(t, std::span<const int32_t>(context), k, factor, offset, min_prob,
                                       tree_spec);
             })
        .def("speculate_ndarray",
             [](SuffixTree& t, const Int32Array1D& context, int k, float factor, float offset, float min_prob,
                bool tree_spec) {
                 return speculate_span(t, as_span(context), k, factor, offset, min_prob, tree_spec);
             })
        // The incremental form: what the call learns is kept under ``handle`` (one per request)
        // and used by the next call with it while the tree is unchanged. Same drafts.
        .def("speculate_handle_ndarray",
             [](SuffixTree& t, const Int32Array1D& context, int k, float factor, float offset, float min_prob,
                int64_t handle) {
                 if (handle < 0) {
                     throw py::value_error("handle: must be >= 0, got " + std::to_string(handle));
                 }
                 return t.speculate_longest_first(as_span(context), k, factor, offset, min_prob, handle);
             })
        .def("forget_handle", &SuffixTree::forget_handle)
        .def("num_handles", &SuffixTree::num_handles)
        .def("mutations", &SuffixTree::mutations)
        .def("walks", &SuffixTree::walks)
        .def("speculate_reference_ndarray",
             [](SuffixTree& t, const Int32Array1D& context, int k, float factor, float offset, float min_prob,
                bool tree_spec) { return t.speculate(as_span(context), k, factor, offset, min_prob, tree_spec); })
        .def("check_integrity", &SuffixTree::check_integrity)
        .def("estimate_memory", &SuffixTree::estimate_memory);
}
