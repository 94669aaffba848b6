// vllm_accel._C_kivi: KIVI paged KV cache on the CPU -- decode attention that reads packed
// pages directly, and quantize-on-write.
//
// One query token per sequence attends over the sequence's paged KIVI cache without
// materialising dequantized K/V (the torch reference dequantizes the whole sequence to fp32
// every step).  Page layout, rounding and the meaning of every region: the module docstring
// of vllm_accel/kernels/kivi_format.py; the Python entry point and its checks:
// vllm_accel/kernels/kivi_cpu.py.
//
// Keys are quantized per channel over key groups, so the per-channel scale folds into the
// query once per group:  q . (c * s + z) = sum_d (q_d s_d) c_d + sum_d q_d z_d.
// Values are quantized per token (value groups of VG channels): each block of tokens is
// dequantized once (c_t s_t + z_t) into a small tile that every query head then sums.
// Codes are unpacked once per group or block and used by every query head of the KV head
// (GQA).
//
// Supported: bits 2/4/8 for K and V, any value group dividing D, sink tokens (the first S
// rows of every page read from their full-precision copies), residual keys of the unfinished
// group passed as fp32 rows (gathered by the caller from either the tail pool or the page's
// residual area).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

// The hot loops' helpers are inlined into each instruction-set copy of attend_one (below), so
// that they vectorize with that copy's instructions.
#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

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

// float -> IEEE half, round to nearest even (what torch's .to(torch.float16) does).
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (a < 0x38800000u) {  // below the smallest normal half: a multiple of 2^-24
    float af;
    std::memcpy(&af, &a, sizeof(af));
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(af * 16777216.f)));
  }
  uint32_t h = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7fffffu) >> 13));
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline void store_half(uint8_t* p, float f) {
  const uint16_t h = float_to_half(f);
  std::memcpy(p, &h, sizeof(h));
}

// A model-dtype element (fp32, or 16-bit: bf16 or fp16) -> float.
inline float load_elem(const uint8_t* p, int64_t elem_bytes, bool bf16) {
  if (elem_bytes == 4) {
    float f;
    std::memcpy(&f, p, sizeof(f));
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  if (!bf16) return half_to_float(h);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Branch-free IEEE half -> float for finite halves (scales and zero points are clamped to
// +-65504 when written): the exponent and mantissa move to float position and one multiply by
// 2^112 rebiases the exponent, exact for normals and subnormals alike.  Inner loops over it
// vectorize, unlike half_to_float's branches.
ALWAYS_INLINE float half_to_float_finite(uint16_t h) {
  const uint32_t mag = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float f;
  std::memcpy(&f, &mag, sizeof(f));
  f *= 0x1p112f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// `n` fp16 values at p -> float.
ALWAYS_INLINE void load_halves(const uint8_t* p, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof(h));
    out[i] = half_to_float_finite(h);
  }
}

// exp(x) for x <= 0 (softmax scores minus their maximum), within ~2 ulp, flushing below e^-87
// to ~1e-38 instead of 0.  Written without calls or branches so that the softmax loop vectorizes
// (over std::exp it does not): x = n ln2 + r with |r| <= ln2/2,
// exp(r) by its degree-6 Taylor polynomial, 2^n by building the float's exponent.
ALWAYS_INLINE float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, sizeof(two_n));
  return p * two_n;
}

// sum_i a[i] b[i] with kLanes partial sums (vectorizes without reassociation flags).
constexpr int64_t kLanes = 16;
ALWAYS_INLINE float dot_lanes(const float* a, const float* b, int64_t n) {
  float lane[kLanes] = {};
  const int64_t body = n / kLanes * kLanes;
  for (int64_t i0 = 0; i0 < body; i0 += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += a[i0 + j] * b[i0 + j];
  }
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += lane[j];
  for (int64_t i = body; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// kTwoBitCodes[b][k] = the k-th 2-bit code of byte b (low bits first), as a float.
struct TwoBitTable {
  float codes[256][4];
  TwoBitTable() {
    for (int b = 0; b < 256; ++b) {
      for (int k = 0; k < 4; ++k) codes[b][k] = static_cast<float>((b >> (2 * k)) & 0x03);
    }
  }
};
const TwoBitTable kTwoBitTable;
const auto& kTwoBitCodes = kTwoBitTable.codes;

// Dequantize `n` channels of one code row (a value group, or a whole key row with s = 1, z = 0;
// byte-aligned, n a multiple of 8): out[c] = code_c * s + z, in one pass (the zero point folded
// in, instead of a separate per-head sum of p_t z_t whose accumulator went through memory).
ALWAYS_INLINE void dequant_group(const uint8_t* row, int bits, int64_t n, float s, float z,
                                 float* out) {
  if (bits == 4) {
    for (int64_t j = 0; j < n / 2; ++j) {
      const uint8_t b = row[j];
      out[2 * j] = static_cast<float>(b & 0x0f) * s + z;
      out[2 * j + 1] = static_cast<float>(b >> 4) * s + z;
    }
  } else if (bits == 2) {  // a byte's four codes as one 4-float row of a table
    for (int64_t j = 0; j < n / 4; ++j) {
      const float* c = kTwoBitCodes[row[j]];
      for (int k = 0; k < 4; ++k) out[4 * j + k] = c[k] * s + z;
    }
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(row[j]) * s + z;
  }
}

// The per-head rows of query heads i0 .. i0+HB-1 (rows[h] = base + head * stride); heads past
// hq repeat the last one, so a pass always runs HB heads (the extra ones are not stored).
template <int HB>
ALWAYS_INLINE void head_rows(const float* base, int64_t stride, int64_t i0, int64_t hq,
                             const float* (&rows)[HB]) {
  for (int h = 0; h < HB; ++h) rows[h] = base + std::min<int64_t>(i0 + h, hq - 1) * stride;
}

// acc[h][x] += sum_j weights[h][j] * tile[j * N + x] over `count` tile rows: each row is loaded
// once for the HB heads (key scores: rows are channels, weights the folded query; values: rows
// are tokens, weights the softmax weights).
template <int HB, int N>
ALWAYS_INLINE void accumulate_heads(const float* const (&weights)[HB], const float* tile,
                                    int64_t count, float (&acc)[HB][N]) {
  for (int64_t j = 0; j < count; ++j) {
    const float* row = tile + j * N;
    for (int h = 0; h < HB; ++h) {
      const float w = weights[h][j];
      for (int64_t x = 0; x < N; ++x) acc[h][x] += w * row[x];
    }
  }
}

struct Geometry {
  int64_t block_stride, head_stride;  // bytes between blocks / KV heads of the cache
  int64_t page_bytes, num_kv_heads, num_q_heads, head_size, block_size, key_group;
  int64_t bits_k, bits_v, value_group;
  int64_t off_kc, off_vc, off_ks, off_kz, off_vs, off_vz;
  // sink rows: the first sink_tokens slots of every page, copies of K and V in the model dtype
  // (sink_elem_bytes per element; 16-bit: bf16 when sink_bf16, else fp16)
  int64_t sink_tokens = 0, off_sk = 0, off_sv = 0, sink_elem_bytes = 2;
  bool sink_bf16 = true;
  float scale;
  // > 0: the pages hold Hadamard-rotated value rows (kv_quant.value_rotation); each output
  // row is multiplied by the unnormalized Hadamard matrix and this factor (1 / sqrt(D)) to
  // rotate it back. D must then be a power of two.
  float rotate_out = 0.f;
};

// In-place Walsh-Hadamard transform of n floats (n a power of two), Sylvester order: x <- H x.
inline void hadamard_inplace(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

// Row r of a page's sink K or V copy (at `region`) as D floats.
inline void load_sink_row(const Geometry& g, const uint8_t* page, int64_t region, int64_t r,
                          float* out) {
  const int64_t E = g.sink_elem_bytes, D = g.head_size;
  const uint8_t* row = page + region + r * D * E;
  for (int64_t d = 0; d < D; ++d) out[d] = load_elem(row + d * E, E, g.sink_bf16);
}

// Scratch buffers of one worker thread.
struct Scratch {
  std::vector<float> scores;  // [hq, seq_len] scores, then softmax weights
  std::vector<float> tile;    // [D, G] codes of one key group, channel-major
  std::vector<float> codes;   // [16, D] codes of 16 key rows, token-major
  std::vector<float> vtile;   // [kValueBlock, D] dequantized values of a block of tokens
  std::vector<float> folded;  // [hq, D + 1] query * key scale, and the q . zero bias
  std::vector<float> kscale;  // [2, D] the key group's scales and zero points as float
  std::vector<float> sink;    // [D] one sink row as float
  std::vector<float> denom;
};

// Attention of the query heads of one KV head of one sequence.  DT / GT > 0 fix D / G at
// compile time (the common head sizes, so every inner loop is a fixed-length vector loop);
// 0 reads them from `g`.  HB > 1 (fixed sizes only) runs HB query heads per pass over a tile.
// Inner loops run over contiguous memory without reductions: key scores as
// score[t] += f[d] * tile[d][t] over the group's tokens, values as
// out[d] += p_t * (code * scale + zero)[t][d].  x86-64 builds carry AVX-512 and AVX2+FMA
// copies (pick_attend).
template <int DT, int GT, int HB>
ALWAYS_INLINE void attend_one(const Geometry& g, const uint8_t* cache, const int32_t* block_row,
                int64_t seq_len, const float* q, const float* tail, float* out, Scratch& w) {
  const int64_t D = DT > 0 ? DT : g.head_size;
  const int64_t G = GT > 0 ? GT : g.key_group;
  const int64_t N = g.block_size;
  const int64_t hq = g.num_q_heads / g.num_kv_heads;
  const int64_t quantized = seq_len / G * G;
  const int64_t k_row = D * g.bits_k / 8, v_row = D * g.bits_v / 8;
  const int64_t vgroups = D / g.value_group;
  // `cache` points at this KV head's page of block 0: page of block b = cache + b * stride
  const int64_t block_stride = g.block_stride;
  w.scores.resize(static_cast<size_t>(hq * seq_len));
  w.tile.resize(static_cast<size_t>(D * G));
  w.codes.resize(static_cast<size_t>(16 * D));
  w.folded.resize(static_cast<size_t>(hq * (D + 1)));
  w.kscale.resize(static_cast<size_t>(2 * D));
  w.sink.resize(static_cast<size_t>(D));
  w.denom.assign(static_cast<size_t>(hq), 0.f);
  float* scores = w.scores.data();
  float* tile = w.tile.data();
  float* codes = w.codes.data();
  float* folded = w.folded.data();
  float* ks = w.kscale.data();
  float* kz = ks + D;

  // --- scores (softmax scale included) over complete (quantized) key groups
  for (int64_t t0 = 0; t0 < quantized; t0 += G) {
    const uint8_t* page = cache + block_row[t0 / N] * block_stride;
    const int64_t first = t0 % N;
    load_halves(page + g.off_ks + (first / G) * D * 2, D, ks);
    load_halves(page + g.off_kz + (first / G) * D * 2, D, kz);
    for (int64_t i = 0; i < hq; ++i) {  // fold the group's channel scales into each query
      const float* qi = q + i * D;
      float* fi = folded + i * (D + 1);
      for (int64_t d = 0; d < D; ++d) fi[d] = qi[d] * g.scale * ks[d];
      fi[D] = dot_lanes(qi, kz, D) * g.scale;
    }
    for (int64_t t0 = 0; t0 < G; t0 += 16) {  // unpack the group channel-major
      const int64_t nt = std::min<int64_t>(16, G - t0);
      for (int64_t r = 0; r < nt; ++r) {
        dequant_group(page + g.off_kc + (first + t0 + r) * k_row, static_cast<int>(g.bits_k), D,
                      1.f, 0.f, codes + r * D);
      }
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t r = 0; r < nt; ++r) tile[d * G + t0 + r] = codes[r * D + d];
      }
    }
    if constexpr (GT > 0) {  // HB heads at a time: each tile row is loaded once for all
      for (int64_t i0 = 0; i0 < hq; i0 += HB) {
        const float* fh[HB];
        head_rows(folded, D + 1, i0, hq, fh);
        float acc[HB][GT];  // the group's scores stay in registers
        for (int h = 0; h < HB; ++h) std::fill(acc[h], acc[h] + GT, fh[h][D]);
        accumulate_heads(fh, tile, D, acc);
        for (int64_t h = 0; h < std::min<int64_t>(HB, hq - i0); ++h) {
          std::copy(acc[h], acc[h] + GT, scores + (i0 + h) * seq_len + t0);
        }
      }
    } else {
      for (int64_t i = 0; i < hq; ++i) {
        const float* fi = folded + i * (D + 1);
        float* si = scores + i * seq_len + t0;
        for (int64_t t = 0; t < G; ++t) si[t] = fi[D];
        for (int64_t d = 0; d < D; ++d) {
          const float f = fi[d];
          const float* row = tile + d * G;
          for (int64_t t = 0; t < G; ++t) si[t] += f * row[t];
        }
      }
    }
    if (first == 0) {  // the page's sink rows: scores from their full-precision keys
      for (int64_t r = 0; r < g.sink_tokens; ++r) {
        load_sink_row(g, page, g.off_sk, r, w.sink.data());
        for (int64_t i = 0; i < hq; ++i) {
          scores[i * seq_len + t0 + r] = dot_lanes(q + i * D, w.sink.data(), D) * g.scale;
        }
      }
    }
  }
  // --- scores over the unfinished group's full-precision keys
  for (int64_t t = quantized; t < seq_len; ++t) {
    const float* k = tail + (t - quantized) * D;
    for (int64_t i = 0; i < hq; ++i) {
      const float* qi = q + i * D;
      scores[i * seq_len + t] = dot_lanes(qi, k, D) * g.scale;
    }
  }
  // --- softmax per query head (weights left unnormalised; divided at the end).  Max and sum
  // keep kLanes partial results so that both loops vectorize without reassociation flags.
  for (int64_t i = 0; i < hq; ++i) {
    float* si = scores + i * seq_len;
    const int64_t body = seq_len / kLanes * kLanes;
    float lane[kLanes];
    std::fill(lane, lane + kLanes, -INFINITY);
    for (int64_t t0 = 0; t0 < body; t0 += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) lane[j] = std::max(lane[j], si[t0 + j]);
    }
    float m = -INFINITY;
    for (int64_t j = 0; j < kLanes; ++j) m = std::max(m, lane[j]);
    for (int64_t t = body; t < seq_len; ++t) m = std::max(m, si[t]);
    std::fill(lane, lane + kLanes, 0.f);
    for (int64_t t0 = 0; t0 < body; t0 += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) {
        si[t0 + j] = exp_nonpositive(si[t0 + j] - m);
        lane[j] += si[t0 + j];
      }
    }
    float sum = 0.f;
    for (int64_t j = 0; j < kLanes; ++j) sum += lane[j];
    for (int64_t t = body; t < seq_len; ++t) {
      si[t] = exp_nonpositive(si[t] - m);
      sum += si[t];
    }
    w.denom[i] = sum;
    std::fill(out + i * D, out + (i + 1) * D, 0.f);
  }
  // --- values, kValueBlock tokens at a time: the block's codes are dequantized once
  // (vtile[t][d] = code * scale + zero, per value group), then each query head sums its
  // weights over the block into accumulators that stay in registers (fixed D).
  constexpr int64_t kValueBlock = 32;
  w.vtile.resize(static_cast<size_t>(kValueBlock * D));
  float* vtile = w.vtile.data();
  const int64_t vg_bytes = g.value_group * g.bits_v / 8;
  for (int64_t b0 = 0; b0 < seq_len; b0 += kValueBlock) {
    const int64_t nb = std::min(kValueBlock, seq_len - b0);
    for (int64_t r = 0; r < nb; ++r) {
      const int64_t t = b0 + r;
      const uint8_t* page = cache + block_row[t / N] * block_stride;
      const int64_t o = t % N;
      if (o < g.sink_tokens) {  // a sink row: its full-precision value
        load_sink_row(g, page, g.off_sv, o, vtile + r * D);
        continue;
      }
      const uint8_t* codes_row = page + g.off_vc + o * v_row;
      for (int64_t vg = 0; vg < vgroups; ++vg) {
        float vs, vz;
        load_halves(page + g.off_vs + (o * vgroups + vg) * 2, 1, &vs);
        load_halves(page + g.off_vz + (o * vgroups + vg) * 2, 1, &vz);
        dequant_group(codes_row + vg * vg_bytes, static_cast<int>(g.bits_v), g.value_group, vs,
                      vz, vtile + r * D + vg * g.value_group);
      }
    }
    if constexpr (DT > 0) {  // HB heads at a time: each value row is loaded once for all
      for (int64_t i0 = 0; i0 < hq; i0 += HB) {
        const float* ph[HB];
        head_rows(scores + b0, seq_len, i0, hq, ph);
        float acc[HB][DT] = {};  // registers
        accumulate_heads(ph, vtile, nb, acc);
        for (int64_t h = 0; h < std::min<int64_t>(HB, hq - i0); ++h) {
          float* oi = out + (i0 + h) * DT;
          for (int64_t d = 0; d < DT; ++d) oi[d] += acc[h][d];
        }
      }
    } else {
      for (int64_t i = 0; i < hq; ++i) {
        const float* pi = scores + i * seq_len + b0;
        float* oi = out + i * D;
        for (int64_t r = 0; r < nb; ++r) {
          const float p = pi[r];
          const float* vr = vtile + r * D;
          for (int64_t d = 0; d < D; ++d) oi[d] += p * vr[d];
        }
      }
    }
  }
  for (int64_t i = 0; i < hq; ++i) {
    float inv = 1.f / w.denom[i];
    if (g.rotate_out > 0.f) {  // back from the rotated value space (linear: before the 1/denom)
      hadamard_inplace(out + i * D, D);
      inv *= g.rotate_out;
    }
    for (int64_t d = 0; d < D; ++d) out[i * D + d] *= inv;
  }
}

using AttendFn = void (*)(const Geometry&, const uint8_t*, const int32_t*, int64_t,
                          const float*, const float*, float*, Scratch&);

// One compiled copy of attend_one per instruction set, chosen at run time (GCC's
// target_clones dispatched to its baseline copy from this module, found with perf).
// ACC_FLOATS: the accumulator floats a copy may keep in registers; with DT and GT fixed, HB =
// ACC_FLOATS / max(DT, GT) query heads (1 to 4) share each loaded tile row (AVX-512: 32 zmm
// registers, 16 of them accumulators; AVX2's 16 ymm registers hold one head's).
constexpr int heads_per_pass(int dt, int gt, int acc_floats) {
  return dt > 0 && gt > 0 ? std::max(1, std::min(4, acc_floats / std::max(dt, gt))) : 1;
}
#define ATTEND_FOR_ISA(NAME, TARGET, ACC_FLOATS)                                             \
  template <int DT, int GT>                                                                  \
  TARGET void NAME(const Geometry& g, const uint8_t* cache, const int32_t* block_row,        \
                   int64_t seq_len, const float* q, const float* tail, float* out,           \
                   Scratch& w) {                                                             \
    attend_one<DT, GT, heads_per_pass(DT, GT, ACC_FLOATS)>(g, cache, block_row, seq_len, q,  \
                                                            tail, out, w);                   \
  }
ATTEND_FOR_ISA(attend_baseline, , 0)
#if defined(__x86_64__) && defined(__GNUC__)
ATTEND_FOR_ISA(attend_avx2, __attribute__((target("avx2,fma,f16c"))), 0)
ATTEND_FOR_ISA(attend_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))),
               256)
#endif

// The widest copy this CPU runs; VLLM_ACCEL_KIVI_ISA=avx2|baseline caps it (tests run every
// copy on one machine).
template <int DT, int GT>
AttendFn pick_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  const char* cap = std::getenv("VLLM_ACCEL_KIVI_ISA");
  const std::string limit = cap ? cap : "";
  __builtin_cpu_init();
  if (limit.empty() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return attend_avx512<DT, GT>;
  }
  if (limit != "baseline" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return attend_avx2<DT, GT>;
  }
#endif
  return attend_baseline<DT, GT>;
}

AttendFn pick_attend(const Geometry& g) {
  if (g.key_group == 64 && g.head_size == 64) return pick_isa<64, 64>();
  if (g.key_group == 64 && g.head_size == 128) return pick_isa<128, 64>();
  return pick_isa<0, 0>();
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

  const AttendFn attend = pick_attend(g);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min(num_threads, items)));
  // OpenMP shares torch's runtime (torch ships libgomp.so.1 and is loaded first): no second
  // thread pool competing with torch's spinning workers.
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t s = item / g.num_kv_heads, h = item % g.num_kv_heads;
      const int64_t len = seq_lens[s];
      float* o = out + (s * g.num_q_heads + h * hq) * D;
      if (len <= 0) {
        std::fill(o, o + hq * D, 0.f);
        continue;
      }
      attend(g, cache + h * g.head_stride, block_table + s * bt_stride, len,
             query + (s * g.num_q_heads + h * hq) * D,
             tail + (s * g.num_kv_heads + h) * g.key_group * D, o, scratch);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Quantize-on-write (vLLM's do_kv_cache_update), byte for byte what the torch reference
// vllm_accel.kernels.kivi_cache._write_torch writes (same fp32 operations in the same order,
// fp16 scales rounded to nearest even).
// ---------------------------------------------------------------------------------------------

// Asymmetric quantization of n values x[i * stride]; returns the fp16-rounded scale and zero.
// The first `skip` values (sink rows) are left out of min/max but still get clamped codes.
inline void quantize_run(const float* x, int64_t n, int64_t stride, int bits, uint8_t* codes,
                         float* scale_out, float* zero_out, int64_t skip = 0) {
  const float qmax = static_cast<float>((1 << bits) - 1);
  float lo = 0.f, hi = 0.f;
  if (skip < n) {
    lo = hi = x[skip * stride];
    for (int64_t i = skip + 1; i < n; ++i) {
      lo = std::min(lo, x[i * stride]);
      hi = std::max(hi, x[i * stride]);
    }
  }
  const float scale = half_to_float(float_to_half(std::min((hi - lo) / qmax, 65504.f)));
  const float zero = half_to_float(float_to_half(std::min(std::max(lo, -65504.f), 65504.f)));
  const float safe = scale > 0.f ? scale : 1.f;
  for (int64_t i = 0; i < n; ++i) {
    const float c = std::floor((x[i * stride] - zero) / safe + 0.5f);
    codes[i] = static_cast<uint8_t>(std::min(std::max(c, 0.f), qmax));
  }
  *scale_out = scale;
  *zero_out = zero;
}

inline void pack_row(const uint8_t* codes, int bits, int64_t d, uint8_t* out) {
  const int per = 8 / bits;
  for (int64_t j = 0; j < d / per; ++j) {
    uint32_t b = 0;
    for (int i = 0; i < per; ++i) b |= static_cast<uint32_t>(codes[j * per + i]) << (i * bits);
    out[j] = static_cast<uint8_t>(b);
  }
}

struct WriteArgs {
  uintptr_t cache, key, value, slots, entries, tail;
  int64_t num_tokens, tail_entry_stride, tail_head_stride;  // tail strides in bytes
  bool bf16;  // model dtype of key/value/tail rows when 16-bit: bf16 (else fp16)
  int64_t elem_bytes;  // bytes of one model-dtype element: 2, or 4 (float32)
};

void write_tokens(const WriteArgs& a, const Geometry& g, int64_t num_threads) {
  auto* cache = reinterpret_cast<uint8_t*>(a.cache);
  const auto* key = reinterpret_cast<const uint8_t*>(a.key);  // 16-bit [T, H, D]
  const auto* value = reinterpret_cast<const uint8_t*>(a.value);
  const auto* slot = reinterpret_cast<const int64_t*>(a.slots);
  const auto* entry = reinterpret_cast<const int64_t*>(a.entries);
  auto* tail = reinterpret_cast<uint8_t*>(a.tail);
  const int64_t H = g.num_kv_heads, D = g.head_size, N = g.block_size, G = g.key_group;
  const int64_t vg_w = g.value_group, vgroups = D / vg_w;
  const int64_t E = a.elem_bytes, row_bytes = D * E, tok_bytes = H * D * E;
  const int64_t T = a.num_tokens;
  auto page_of = [&](int64_t s, int64_t h) {
    return cache + (s / N) * g.block_stride + h * g.head_stride;
  };
  auto tail_row = [&](int64_t e, int64_t h, int64_t r) {
    return tail + e * a.tail_entry_stride + h * a.tail_head_stride + r * row_bytes;
  };
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min(num_threads, T * H)));
  // pass 1: key groups completed by this call (reading the tail as it was), values
#pragma omp parallel num_threads(threads) if (threads > 1 && T * H >= 64)
  {
    std::vector<float> x(static_cast<size_t>(G * D));
    std::vector<uint8_t> codes(static_cast<size_t>(G * D)), col(static_cast<size_t>(G));
#pragma omp for schedule(static)
    for (int64_t th = 0; th < T * H; ++th) {
      const int64_t t = th / H, h = th % H, s = slot[t];
      if (s < 0) continue;
      const int64_t off = s % N;
      uint8_t* page = page_of(s, h);
      if ((off + 1) % G == 0) {
        for (int64_t r = 0; r < G; ++r) {
          const int64_t back = G - 1 - r, cand = t - back;
          const bool from_in = cand >= 0 && slot[cand] == s - back;
          const uint8_t* src = from_in ? key + cand * tok_bytes + h * row_bytes
                                       : tail_row(entry[t], h, r);
          for (int64_t d = 0; d < D; ++d) x[r * D + d] = load_elem(src + E * d, E, a.bf16);
        }
        const int64_t grp = off / G;
        for (int64_t d = 0; d < D; ++d) {  // per channel over the group's G rows
          float sc, ze;
          quantize_run(x.data() + d, G, D, static_cast<int>(g.bits_k), col.data(), &sc, &ze,
                       grp == 0 ? g.sink_tokens : 0);
          for (int64_t r = 0; r < G; ++r) codes[r * D + d] = col[r];
          store_half(page + g.off_ks + (grp * D + d) * 2, sc);
          store_half(page + g.off_kz + (grp * D + d) * 2, ze);
        }
        const int64_t k_row = D * g.bits_k / 8;
        for (int64_t r = 0; r < G; ++r) {
          pack_row(codes.data() + r * D, static_cast<int>(g.bits_k), D,
                   page + g.off_kc + (grp * G + r) * k_row);
        }
      }
      const uint8_t* vrow = value + t * tok_bytes + h * row_bytes;
      if (off < g.sink_tokens) {  // sink rows: full-precision copies of K and V
        std::memcpy(page + g.off_sk + off * row_bytes, key + t * tok_bytes + h * row_bytes,
                    static_cast<size_t>(row_bytes));
        std::memcpy(page + g.off_sv + off * row_bytes, vrow, static_cast<size_t>(row_bytes));
      }
      for (int64_t d = 0; d < D; ++d) x[d] = load_elem(vrow + E * d, E, a.bf16);
      for (int64_t vg = 0; vg < vgroups; ++vg) {
        float sc, ze;
        quantize_run(x.data() + vg * vg_w, vg_w, 1, static_cast<int>(g.bits_v),
                     codes.data() + vg * vg_w, &sc, &ze);
        store_half(page + g.off_vs + (off * vgroups + vg) * 2, sc);
        store_half(page + g.off_vz + (off * vgroups + vg) * 2, ze);
      }
      pack_row(codes.data(), static_cast<int>(g.bits_v), D,
               page + g.off_vc + off * (D * g.bits_v / 8));
    }
  }
  // pass 2: residual keys, in batch order (the last writer of an (entry, row) wins)
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(tail_row(entry[t], h, (slot[t] % N) % G), key + t * tok_bytes + h * row_bytes,
                  static_cast<size_t>(row_bytes));
    }
  }
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
      .def_readwrite("sink_tokens", &Geometry::sink_tokens)
      .def_readwrite("off_sk", &Geometry::off_sk)
      .def_readwrite("off_sv", &Geometry::off_sv)
      .def_readwrite("sink_elem_bytes", &Geometry::sink_elem_bytes)
      .def_readwrite("sink_bf16", &Geometry::sink_bf16)
      .def_readwrite("scale", &Geometry::scale)
      .def_readwrite("rotate_out", &Geometry::rotate_out);
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
  py::class_<WriteArgs>(m, "WriteArgs")
      .def(py::init<>())
      .def_readwrite("cache", &WriteArgs::cache)
      .def_readwrite("key", &WriteArgs::key)
      .def_readwrite("value", &WriteArgs::value)
      .def_readwrite("slots", &WriteArgs::slots)
      .def_readwrite("entries", &WriteArgs::entries)
      .def_readwrite("tail", &WriteArgs::tail)
      .def_readwrite("num_tokens", &WriteArgs::num_tokens)
      .def_readwrite("tail_entry_stride", &WriteArgs::tail_entry_stride)
      .def_readwrite("tail_head_stride", &WriteArgs::tail_head_stride)
      .def_readwrite("bf16", &WriteArgs::bf16)
      .def_readwrite("elem_bytes", &WriteArgs::elem_bytes);
  m.def(
      "write",
      [](const WriteArgs& args, const Geometry& g, int64_t num_threads) {
        py::gil_scoped_release release;
        write_tokens(args, g, num_threads);
      },
      py::arg("args"), py::arg("geometry"), py::arg("num_threads"));
}
