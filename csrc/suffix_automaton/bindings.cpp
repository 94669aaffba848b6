// pybind11 bindings: the vllm_accel._C_sam extension module.
//
// The Python-facing API (argument names, defaults, strategy names, exceptions)
// must stay identical to the pure-Python fallback in
// vllm_accel/spec_decode/_sam_python.py; the unit tests run both.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "suffix_automaton.hpp"

namespace py = pybind11;
using vllm_accel::sam::DraftStrategy;
using vllm_accel::sam::FormatError;
using vllm_accel::sam::IoError;
using vllm_accel::sam::Matcher;
using vllm_accel::sam::OverflowPolicy;
using vllm_accel::sam::SuffixAutomaton;

namespace {

// Token batches this long are processed without holding the GIL.
constexpr size_t kReleaseGilAbove = 1024;

DraftStrategy parse_strategy(const std::string& name) {
  if (name == "recent") return DraftStrategy::kRecent;
  if (name == "first") return DraftStrategy::kFirst;
  if (name == "frequent") return DraftStrategy::kFrequent;
  throw py::value_error("unknown draft strategy '" + name +
                        "' (expected 'recent', 'first' or 'frequent')");
}

OverflowPolicy parse_policy(const std::string& name) {
  if (name == "rebuild") return OverflowPolicy::kRebuild;
  if (name == "freeze") return OverflowPolicy::kFreeze;
  throw py::value_error("unknown on_full policy '" + name +
                        "' (expected 'rebuild' or 'freeze')");
}

int32_t checked_token(long long value) {
  if (value < std::numeric_limits<int32_t>::min() ||
      value > std::numeric_limits<int32_t>::max()) {
    throw py::value_error("token id out of int32 range: " + std::to_string(value));
  }
  return static_cast<int32_t>(value);
}

bool host_is_little_endian() {
  const uint16_t probe = 1;
  unsigned char first_byte;
  std::memcpy(&first_byte, &probe, 1);
  return first_byte == 1;
}

// Reads a 1-D integer buffer (numpy array, array.array, bytes, ...).  Returns
// false for formats it does not handle, which then go through iteration.
bool read_integer_buffer(py::handle obj, std::vector<int32_t>& out) {
  py::buffer_info info;
  try {
    info = py::reinterpret_borrow<py::buffer>(obj).request();
  } catch (const py::error_already_set&) {
    return false;
  }
  std::string format = info.format;
  if (!format.empty() && (format[0] == '@' || format[0] == '=' ||
                          (format[0] == '<' && host_is_little_endian()))) {
    format.erase(0, 1);
  }
  if (info.ndim != 1 || format.size() != 1) return false;
  const char code = format[0];
  const bool is_signed = std::strchr("bhilqn", code) != nullptr;
  const bool is_unsigned = std::strchr("BHILQN", code) != nullptr;
  if (!is_signed && !is_unsigned) return false;

  const auto* base = static_cast<const char*>(info.ptr);
  const py::ssize_t stride = info.strides[0];
  out.resize(static_cast<size_t>(info.shape[0]));
  auto read_all = [&](auto tag) {
    using T = decltype(tag);
    for (size_t i = 0; i < out.size(); ++i) {
      T value;
      std::memcpy(&value, base + static_cast<py::ssize_t>(i) * stride, sizeof(T));
      if constexpr (std::is_unsigned_v<T>) {
        if (value > static_cast<T>(std::numeric_limits<int32_t>::max())) {
          throw py::value_error("token id out of int32 range: " + std::to_string(value));
        }
        out[i] = static_cast<int32_t>(value);
      } else {
        out[i] = checked_token(static_cast<long long>(value));
      }
    }
  };
  switch (info.itemsize) {
    case 1: is_signed ? read_all(int8_t{}) : read_all(uint8_t{}); break;
    case 2: is_signed ? read_all(int16_t{}) : read_all(uint16_t{}); break;
    case 4: is_signed ? read_all(int32_t{}) : read_all(uint32_t{}); break;
    case 8: is_signed ? read_all(int64_t{}) : read_all(uint64_t{}); break;
    default: out.clear(); return false;
  }
  return true;
}

// Converts any iterable of integers (objects with __index__) to token ids.
int32_t token_from_object(PyObject* item) {
  // Exact ints (the common case) skip the __index__ round trip.
  py::object index = PyLong_CheckExact(item)
                         ? py::reinterpret_borrow<py::object>(item)
                         : py::reinterpret_steal<py::object>(PyNumber_Index(item));
  if (!index) throw py::error_already_set();  // TypeError for floats, strings, ...
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) {
    throw py::value_error("token id out of int32 range: " + py::str(index).cast<std::string>());
  }
  if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
  return checked_token(value);
}

std::vector<int32_t> to_tokens(py::handle obj) {
  std::vector<int32_t> out;
  PyObject* ptr = obj.ptr();
  if (PyList_CheckExact(ptr) || PyTuple_CheckExact(ptr)) {
    // Fast path for lists/tuples of exact ints: no iterator, and no Python
    // code (__index__) runs that could mutate the list under us.
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(ptr);
    PyObject** items = PySequence_Fast_ITEMS(ptr);
    out.reserve(static_cast<size_t>(size));
    for (Py_ssize_t i = 0; i < size && PyLong_CheckExact(items[i]); ++i) {
      out.push_back(token_from_object(items[i]));
    }
    if (out.size() == static_cast<size_t>(size)) return out;
    out.clear();  // some item is not an exact int: take the generic path
  }
  if (PyObject_CheckBuffer(ptr) && read_integer_buffer(obj, out)) return out;
  for (py::handle item : py::iter(obj)) out.push_back(token_from_object(item.ptr()));
  return out;
}

void extend_tokens(SuffixAutomaton& sam, py::handle tokens) {
  const std::vector<int32_t> ids = to_tokens(tokens);
  if (ids.size() > kReleaseGilAbove) {
    py::gil_scoped_release release;
    sam.extend(ids.data(), ids.size());
  } else {
    sam.extend(ids.data(), ids.size());
  }
}

constexpr const char* kDraftDoc =
    "Up to k continuation tokens of the current match; [] when match_len < "
    "max(min_match, 1).  strategy: 'recent' (copy after a recent earlier "
    "occurrence, default), 'first' (copy after the earliest occurrence) or "
    "'frequent' (greedy most frequent next token; stops when the product of "
    "conditional frequencies drops below min_prob).";

}  // namespace

PYBIND11_MODULE(_C_sam, m) {
  m.doc() = "Native suffix automaton for model-free speculative decoding.";
  m.attr("FORMAT_VERSION") = SuffixAutomaton::kFormatVersion;
  m.attr("MIN_MAX_STATES") = SuffixAutomaton::kMinMaxStates;

  py::register_exception<FormatError>(m, "SAMFormatError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const IoError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    }
  });

  py::class_<SuffixAutomaton>(m, "SuffixAutomaton")
      .def(py::init([](std::optional<int64_t> max_states, const std::string& on_full) {
             if (max_states && *max_states <= 0) {
               throw py::value_error("max_states must be positive (or None for unbounded)");
             }
             return SuffixAutomaton(max_states.value_or(0), parse_policy(on_full));
           }),
           py::arg("max_states") = py::none(), py::arg("on_full") = "rebuild")
      .def("extend", &extend_tokens, py::arg("tokens"),
           "Append token ids (any iterable of ints or 1-D integer buffer).")
      .def("freeze", &SuffixAutomaton::freeze,
           "Stop growing for good; later extend() calls only move the match.")
      .def(
          "draft",
          [](const SuffixAutomaton& sam, int k, int min_match, const std::string& strategy,
             double min_prob) {
            return sam.draft(k, min_match, parse_strategy(strategy), min_prob);
          },
          py::arg("k"), py::arg("min_match") = 1, py::arg("strategy") = "recent",
          py::arg("min_prob") = 0.0, kDraftDoc)
      .def(
          "count",
          [](const SuffixAutomaton& sam, py::handle pattern) {
            const std::vector<int32_t> ids = to_tokens(pattern);
            return sam.count_occurrences(ids.data(), ids.size());
          },
          py::arg("pattern"), "Number of occurrences of pattern in the automaton's text.")
      .def("tokens", &SuffixAutomaton::tokens, "The token ids the automaton is built from.")
      .def("memory_bytes", &SuffixAutomaton::memory_bytes,
           "Bytes held by the automaton's arrays (capacity, not size).")
      .def(
          "matcher", [](const SuffixAutomaton& sam) { return Matcher(sam); },
          py::keep_alive<0, 1>(), "A new SuffixAutomatonMatcher over this (frozen) automaton.")
      .def(
          "save",
          [](const SuffixAutomaton& sam, const std::filesystem::path& path) {
            py::gil_scoped_release release;
            sam.save(path.string());
          },
          py::arg("path"))
      .def_static(
          "load",
          [](const std::filesystem::path& path) {
            py::gil_scoped_release release;
            return SuffixAutomaton::load(path.string());
          },
          py::arg("path"), "Load a saved automaton; the result is frozen.")
      .def_property_readonly("match_len",
                             [](const SuffixAutomaton& sam) { return sam.cursor().length; })
      .def_property_readonly("match_end",
                             [](const SuffixAutomaton& sam) { return sam.cursor().end; })
      .def_property_readonly("frozen", &SuffixAutomaton::frozen)
      .def_property_readonly("num_states", &SuffixAutomaton::num_states)
      .def_property_readonly("num_transitions", &SuffixAutomaton::num_transitions)
      .def_property_readonly("num_tokens", &SuffixAutomaton::num_tokens)
      .def_property_readonly("total_tokens", &SuffixAutomaton::total_tokens)
      .def_property_readonly("num_rebuilds", &SuffixAutomaton::num_rebuilds)
      .def_property_readonly("max_states",
                             [](const SuffixAutomaton& sam) -> std::optional<int64_t> {
                               if (sam.max_states() <= 0) return std::nullopt;
                               return sam.max_states();
                             })
      .def_property_readonly("on_full",
                             [](const SuffixAutomaton& sam) {
                               return sam.policy() == OverflowPolicy::kFreeze ? "freeze"
                                                                              : "rebuild";
                             })
      .def("__repr__", [](const SuffixAutomaton& sam) {
        return "<SuffixAutomaton native tokens=" + std::to_string(sam.num_tokens()) +
               " states=" + std::to_string(sam.num_states()) +
               " match_len=" + std::to_string(sam.cursor().length) +
               (sam.frozen() ? " frozen>" : ">");
      });

  py::class_<Matcher>(m, "SuffixAutomatonMatcher")
      .def(py::init<const SuffixAutomaton&>(), py::arg("automaton"), py::keep_alive<1, 2>())
      .def("reset", &Matcher::reset, "Forget the fed sequence.")
      .def(
          "feed",
          [](Matcher& matcher, py::handle tokens) {
            const std::vector<int32_t> ids = to_tokens(tokens);
            matcher.feed(ids.data(), ids.size());
          },
          py::arg("tokens"), "Append token ids to the query sequence.")
      .def(
          "draft",
          [](const Matcher& matcher, int k, int min_match, const std::string& strategy,
             double min_prob) {
            return matcher.draft(k, min_match, parse_strategy(strategy), min_prob);
          },
          py::arg("k"), py::arg("min_match") = 1, py::arg("strategy") = "recent",
          py::arg("min_prob") = 0.0, kDraftDoc)
      .def_property_readonly("match_len", [](const Matcher& mt) { return mt.cursor().length; })
      .def_property_readonly("match_end", [](const Matcher& mt) { return mt.cursor().end; });
}
