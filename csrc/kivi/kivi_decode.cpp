// vllm_accel._C_kivi: decode attention that reads KIVI-packed pages directly (CPU).
//
// One query token per sequence attends over the sequence's paged KIVI cache without
// materialising dequantized K/V (the torch reference dequantizes the whole sequence to fp32
// every step).  Page layout, rounding and the meaning of every region: the module docstring
// of vllm_accel/kernels/kivi_format.py; the Python entry point and its checks:
// vllm_accel/kernels/kivi_cpu.py.
//
// Keys are quantized per channel over key groups, so the per-channel scale folds into the
// query once per group:  q . (c * s + z) = sum_d (q_d s_d) c_d + sum_d q_d z_d.
// Values are quantized per token (value groups of VG channels), so their scale folds into
// the softmax weight:     sum_t p_t (c_t s_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t.
// Codes are unpacked once per token and used by every query head of the KV head (GQA).
//
// Supported: bits 2/4/8 for K and V, any value group dividing D, no sink tokens, residual
// keys of the unfinished group passed as fp32 rows (gathered by the caller from either the
// tail pool or the page's residual area).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

// IEEE half -> float (scales and zero points are float16 in the page).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return half_to_float(h);
}

// Unpack one token row of `d` codes (low channel in the low bits of each byte).
inline void unpack_row(const uint8_t* row, int bits, int d, float* out) {
  if (bits == 4) {
    for (int j = 0; j < d / 2; ++j) {
      const uint8_t b = row[j];
      out[2 * j] = static_cast<float>(b & 0x0f);
      out[2 * j + 1] = static_cast<float>(b >> 4);
    }
  } else if (bits == 2) {
    for (int j = 0; j < d / 4; ++j) {
      const uint8_t b = row[j];
      out[4 * j] = static_cast<float>(b & 0x03);
      out[4 * j + 1] = static_cast<float>((b >> 2) & 0x03);
      out[4 * j + 2] = static_cast<float>((b >> 4) & 0x03);
      out[4 * j + 3] = static_cast<float>(b >> 6);
    }
  } else {
    for (int j = 0; j < d; ++j) out[j] = static_cast<float>(row[j]);
  }
}

struct Geometry {
  int64_t block_stride, head_stride;  // bytes between blocks / KV heads of the cache
  int64_t page_bytes, num_kv_heads, num_q_heads, head_size, block_size, key_group;
  int64_t bits_k, bits_v, value_group;
  int64_t off_kc, off_vc, off_ks, off_kz, off_vs, off_vz;
  float scale;
};

// Attention of the query heads of KV head `h` of sequence `s`.
void attend_one(const Geometry& g, const uint8_t* cache, const int32_t* block_row,
                int64_t seq_len, const float* q, const float* tail, float* out,
                std::vector<float>& scores, std::vector<float>& codes,
                std::vector<float>& folded) {
  const int64_t D = g.head_size, N = g.block_size, G = g.key_group;
  const int64_t hq = g.num_q_heads / g.num_kv_heads;
  const int64_t quantized = seq_len / G * G;
  const int64_t k_row = D * g.bits_k / 8, v_row = D * g.bits_v / 8;
  const int64_t vgroups = D / g.value_group;
  scores.assign(static_cast<size_t>(hq * seq_len), 0.f);
  codes.resize(static_cast<size_t>(D));
  folded.resize(static_cast<size_t>(hq * (D + 1)));

  // `cache` already points at KV head h of block 0: page of token t = cache + block * stride
  const int64_t block_stride = g.block_stride;
  // --- scores over complete (quantized) key groups
  for (int64_t t0 = 0; t0 < quantized; t0 += G) {
    const uint8_t* page = cache + block_row[t0 / N] * block_stride;
    const int64_t grp = (t0 % N) / G;
    const uint8_t* ks = page + g.off_ks + grp * D * 2;
    const uint8_t* kz = page + g.off_kz + grp * D * 2;
    for (int64_t i = 0; i < hq; ++i) {  // fold the group's channel scales into each query
      const float* qi = q + i * D;
      float* fi = folded.data() + i * (D + 1);
      float bias = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        fi[d] = qi[d] * load_half(ks + 2 * d);
        bias += qi[d] * load_half(kz + 2 * d);
      }
      fi[D] = bias;
    }
    for (int64_t t = t0; t < t0 + G; ++t) {
      unpack_row(page + g.off_kc + (t % N) * k_row, static_cast<int>(g.bits_k),
                 static_cast<int>(D), codes.data());
      for (int64_t i = 0; i < hq; ++i) {
        const float* fi = folded.data() + i * (D + 1);
        float acc = fi[D];
        for (int64_t d = 0; d < D; ++d) acc += fi[d] * codes[d];
        scores[i * seq_len + t] = acc;
      }
    }
  }
  // --- scores over the unfinished group's full-precision keys
  for (int64_t t = quantized; t < seq_len; ++t) {
    const float* k = tail + (t - quantized) * D;
    for (int64_t i = 0; i < hq; ++i) {
      const float* qi = q + i * D;
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += qi[d] * k[d];
      scores[i * seq_len + t] = acc;
    }
  }
  // --- softmax per query head (weights left unnormalised; divided at the end)
  std::vector<float> denom(static_cast<size_t>(hq));
  for (int64_t i = 0; i < hq; ++i) {
    float* si = scores.data() + i * seq_len;
    float m = -INFINITY;
    for (int64_t t = 0; t < seq_len; ++t) {
      si[t] *= g.scale;
      m = std::max(m, si[t]);
    }
    float sum = 0.f;
    for (int64_t t = 0; t < seq_len; ++t) {
      si[t] = std::exp(si[t] - m);
      sum += si[t];
    }
    denom[i] = sum;
    std::fill(out + i * D, out + (i + 1) * D, 0.f);
  }
  // --- values: per-token scales fold into the weights
  std::vector<float> zsum(static_cast<size_t>(hq * vgroups), 0.f);
  for (int64_t t = 0; t < seq_len; ++t) {
    const uint8_t* page = cache + block_row[t / N] * block_stride;
    const int64_t o = t % N;
    unpack_row(page + g.off_vc + o * v_row, static_cast<int>(g.bits_v), static_cast<int>(D),
               codes.data());
    for (int64_t vg = 0; vg < vgroups; ++vg) {
      const float vs = load_half(page + g.off_vs + (o * vgroups + vg) * 2);
      const float vz = load_half(page + g.off_vz + (o * vgroups + vg) * 2);
      const int64_t d0 = vg * g.value_group, d1 = d0 + g.value_group;
      for (int64_t i = 0; i < hq; ++i) {
        const float p = scores[i * seq_len + t];
        const float w = p * vs;
        float* oi = out + i * D;
        for (int64_t d = d0; d < d1; ++d) oi[d] += w * codes[d];
        zsum[i * vgroups + vg] += p * vz;
      }
    }
  }
  for (int64_t i = 0; i < hq; ++i) {
    float* oi = out + i * D;
    const float inv = 1.f / denom[i];
    for (int64_t vg = 0; vg < vgroups; ++vg) {
      const float z = zsum[i * vgroups + vg];
      for (int64_t d = vg * g.value_group; d < (vg + 1) * g.value_group; ++d) {
        oi[d] = (oi[d] + z) * inv;
      }
    }
  }
}

// Decode attention for `num_seqs` sequences, one query token each.
//   cache:       uint8 pages, (block, KV head) at block * block_stride + head * head_stride
//   block_table: int32 [num_seqs, bt_stride]
//   seq_lens:    int32 [num_seqs] (tokens in the cache, the query's own included)
//   query/out:   fp32  [num_seqs, H_q, D]
//   tail:        fp32  [num_seqs, H_kv, key_group, D]: rows 0 .. seq_len % key_group - 1
//                of each sequence's unfinished key group
void decode(uintptr_t cache_ptr, uintptr_t block_table_ptr, int64_t bt_stride,
            uintptr_t seq_lens_ptr, int64_t num_seqs, uintptr_t query_ptr, uintptr_t tail_ptr,
            uintptr_t out_ptr, const Geometry& g, int64_t num_threads) {
  const auto* cache = reinterpret_cast<const uint8_t*>(cache_ptr);
  const auto* block_table = reinterpret_cast<const int32_t*>(block_table_ptr);
  const auto* seq_lens = reinterpret_cast<const int32_t*>(seq_lens_ptr);
  const auto* query = reinterpret_cast<const float*>(query_ptr);
  const auto* tail = reinterpret_cast<const float*>(tail_ptr);
  auto* out = reinterpret_cast<float*>(out_ptr);
  const int64_t D = g.head_size, hq = g.num_q_heads / g.num_kv_heads;
  const int64_t items = num_seqs * g.num_kv_heads;

  auto run = [&](int64_t first, int64_t step) {
    std::vector<float> scores, codes, folded;
    for (int64_t item = first; item < items; item += step) {
      const int64_t s = item / g.num_kv_heads, h = item % g.num_kv_heads;
      const int64_t len = seq_lens[s];
      float* o = out + (s * g.num_q_heads + h * hq) * D;
      if (len <= 0) {
        std::fill(o, o + hq * D, 0.f);
        continue;
      }
      attend_one(g, cache + h * g.head_stride, block_table + s * bt_stride, len,
                 query + (s * g.num_q_heads + h * hq) * D,
                 tail + (s * g.num_kv_heads + h) * g.key_group * D, o, scores, codes, folded);
    }
  };
  const int64_t threads = std::max<int64_t>(1, std::min(num_threads, items));
  if (threads == 1) {
    run(0, 1);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, t, threads);
  run(0, threads);
  for (auto& th : pool) th.join();
}

}  // namespace

PYBIND11_MODULE(_C_kivi, m) {
  m.doc() = "KIVI decode attention over packed pages (CPU); see vllm_accel/kernels/kivi_cpu.py";
  py::class_<Geometry>(m, "Geometry")
      .def(py::init<>())
      .def_readwrite("block_stride", &Geometry::block_stride)
      .def_readwrite("head_stride", &Geometry::head_stride)
      .def_readwrite("page_bytes", &Geometry::page_bytes)
      .def_readwrite("num_kv_heads", &Geometry::num_kv_heads)
      .def_readwrite("num_q_heads", &Geometry::num_q_heads)
      .def_readwrite("head_size", &Geometry::head_size)
      .def_readwrite("block_size", &Geometry::block_size)
      .def_readwrite("key_group", &Geometry::key_group)
      .def_readwrite("bits_k", &Geometry::bits_k)
      .def_readwrite("bits_v", &Geometry::bits_v)
      .def_readwrite("value_group", &Geometry::value_group)
      .def_readwrite("off_kc", &Geometry::off_kc)
      .def_readwrite("off_vc", &Geometry::off_vc)
      .def_readwrite("off_ks", &Geometry::off_ks)
      .def_readwrite("off_kz", &Geometry::off_kz)
      .def_readwrite("off_vs", &Geometry::off_vs)
      .def_readwrite("off_vz", &Geometry::off_vz)
      .def_readwrite("scale", &Geometry::scale);
  m.def(
      "decode",
      [](uintptr_t cache, uintptr_t block_table, int64_t bt_stride, uintptr_t seq_lens,
         int64_t num_seqs, uintptr_t query, uintptr_t tail, uintptr_t out, const Geometry& g,
         int64_t num_threads) {
        py::gil_scoped_release release;
        decode(cache, block_table, bt_stride, seq_lens, num_seqs, query, tail, out, g,
               num_threads);
      },
      py::arg("cache"), py::arg("block_table"), py::arg("bt_stride"), py::arg("seq_lens"),
      py::arg("num_seqs"), py::arg("query"), py::arg("tail"), py::arg("out"),
      py::arg("geometry"), py::arg("num_threads"));
}
