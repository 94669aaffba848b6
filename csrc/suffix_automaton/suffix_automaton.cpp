// Suffix automaton over 32-bit token ids: construction, matching, drafting and
// the versioned binary file format.  See suffix_automaton.hpp for the design.
#include "suffix_automaton.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

namespace vllm_accel {
namespace sam {

namespace {

// ---------------------------------------------------------------------------
// Hashing and checksums
// ---------------------------------------------------------------------------

// splitmix64 finaliser: spreads (state, token) keys over the table.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), identical to
// Python's zlib.crc32, so the pure-Python implementation can verify files.
uint32_t crc32(const unsigned char* data, size_t size) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int bit = 0; bit < 8; ++bit) {
        c = (c & 1U) ? (0xEDB88320U ^ (c >> 1)) : (c >> 1);
      }
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFU;
  for (size_t i = 0; i < size; ++i) {
    crc = table[(crc ^ data[i]) & 0xFFU] ^ (crc >> 8);
  }
  return crc ^ 0xFFFFFFFFU;
}

// ---------------------------------------------------------------------------
// Little-endian serialisation helpers
// ---------------------------------------------------------------------------

bool host_is_little_endian() {
  const uint16_t probe = 1;
  unsigned char first_byte;
  std::memcpy(&first_byte, &probe, 1);
  return first_byte == 1;
}

template <typename T>
T byte_swapped(T value) {
  unsigned char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  std::reverse(bytes, bytes + sizeof(T));
  std::memcpy(&value, bytes, sizeof(T));
  return value;
}

class ByteWriter {
 public:
  template <typename T>
  void scalar(T value) {
    if (!host_is_little_endian()) value = byte_swapped(value);
    const auto* p = reinterpret_cast<const unsigned char*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void int32_array(const std::vector<int32_t>& values) {
    if (!host_is_little_endian()) {
      for (int32_t v : values) scalar(v);
      return;
    }
    const auto* p = reinterpret_cast<const unsigned char*>(values.data());
    bytes_.insert(bytes_.end(), p, p + values.size() * sizeof(int32_t));
  }
  void raw(const char* data, size_t size) {
    bytes_.insert(bytes_.end(), data, data + size);
  }
  std::vector<unsigned char>& bytes() { return bytes_; }

 private:
  std::vector<unsigned char> bytes_;
};

class ByteReader {
 public:
  ByteReader(const unsigned char* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T scalar() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return host_is_little_endian() ? value : byte_swapped(value);
  }
  std::vector<int32_t> int32_array(size_t count) {
    need(count * sizeof(int32_t));
    std::vector<int32_t> values(count);
    std::memcpy(values.data(), data_ + pos_, count * sizeof(int32_t));
    pos_ += count * sizeof(int32_t);
    if (!host_is_little_endian()) {
      for (auto& v : values) v = byte_swapped(v);
    }
    return values;
  }
  const unsigned char* take(size_t size) {
    need(size);
    const unsigned char* p = data_ + pos_;
    pos_ += size;
    return p;
  }

 private:
  void need(size_t size) const {
    if (size > size_ - pos_) throw FormatError("suffix automaton file is truncated");
  }
  const unsigned char* data_;
  size_t size_;
  size_t pos_ = 0;
};

// File layout, all little-endian:
//   header  magic[8] "VLLMASAM", u32 version, u32 reserved (0),
//           u64 num_tokens N, u64 num_states S, u64 num_edges E
//   payload i32 text[N], len[S], link[S], first_end[S], recent_end[S],
//           edges[E] as (src, token, dst) triples sorted by (src, token)
//   trailer u32 CRC-32 of every preceding byte
constexpr char kMagic[8] = {'V', 'L', 'L', 'M', 'A', 'S', 'A', 'M'};
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 3 * 8;
constexpr size_t kTrailerBytes = 4;

}  // namespace

// ---------------------------------------------------------------------------
// TransitionMap
// ---------------------------------------------------------------------------

TransitionMap::TransitionMap() : keys_(16, kEmpty), values_(16, -1), mask_(15) {}

size_t TransitionMap::slot_of(uint64_t key) const {
  size_t slot = size_t(mix64(key)) & mask_;
  while (keys_[slot] != kEmpty && keys_[slot] != key) slot = (slot + 1) & mask_;
  return slot;
}

int32_t TransitionMap::find(int32_t state, int32_t token) const {
  const uint64_t key = pack(state, token);
  const size_t slot = slot_of(key);
  return keys_[slot] == key ? values_[slot] : -1;
}

int32_t* TransitionMap::find_mutable(int32_t state, int32_t token) {
  const uint64_t key = pack(state, token);
  const size_t slot = slot_of(key);
  return keys_[slot] == key ? &values_[slot] : nullptr;
}

void TransitionMap::insert(int32_t state, int32_t token, int32_t target) {
  if ((size_ + 1) * 2 > keys_.size()) grow();
  const uint64_t key = pack(state, token);
  const size_t slot = slot_of(key);
  keys_[slot] = key;
  values_[slot] = target;
  ++size_;
}

void TransitionMap::grow() {
  std::vector<uint64_t> old_keys(keys_.size() * 2, kEmpty);
  std::vector<int32_t> old_values(values_.size() * 2, -1);
  old_keys.swap(keys_);
  old_values.swap(values_);
  mask_ = keys_.size() - 1;
  for (size_t i = 0; i < old_keys.size(); ++i) {
    if (old_keys[i] == kEmpty) continue;
    const size_t slot = slot_of(old_keys[i]);
    keys_[slot] = old_keys[i];
    values_[slot] = old_values[i];
  }
}

void TransitionMap::clear() {
  // Keeps the capacity: a rebuilt automaton grows back to the same size.
  std::fill(keys_.begin(), keys_.end(), kEmpty);
  size_ = 0;
}

size_t TransitionMap::memory_bytes() const {
  return keys_.capacity() * sizeof(uint64_t) + values_.capacity() * sizeof(int32_t);
}

// ---------------------------------------------------------------------------
// Construction
// ---------------------------------------------------------------------------

SuffixAutomaton::SuffixAutomaton(int64_t max_states, OverflowPolicy policy)
    : max_states_(max_states > 0 ? max_states : 0), policy_(policy) {
  if (max_states > 0 && max_states < kMinMaxStates) {
    throw std::invalid_argument("max_states must be >= " +
                                std::to_string(kMinMaxStates) + " (or None for unbounded)");
  }
  reset_to_empty();
}

void SuffixAutomaton::reset_to_empty() {
  len_.clear();
  link_.clear();
  first_end_.clear();
  recent_end_.clear();
  edge_head_.clear();
  edge_token_.clear();
  edge_next_.clear();
  transitions_.clear();
  text_.clear();
  new_state(/*len=*/0, /*link=*/-1, /*first_end=*/-1, /*recent_end=*/-1);  // root
  last_ = 0;
  cursor_ = MatchCursor{};
  counts_valid_ = false;
}

int32_t SuffixAutomaton::new_state(int32_t len, int32_t link, int32_t first_end,
                                   int32_t recent_end) {
  const auto id = static_cast<int32_t>(len_.size());
  len_.push_back(len);
  link_.push_back(link);
  first_end_.push_back(first_end);
  recent_end_.push_back(recent_end);
  edge_head_.push_back(-1);
  return id;
}

void SuffixAutomaton::add_transition(int32_t from, int32_t token, int32_t to) {
  transitions_.insert(from, token, to);
  edge_token_.push_back(token);
  edge_next_.push_back(edge_head_[from]);
  edge_head_[from] = static_cast<int32_t>(edge_token_.size() - 1);
}

bool SuffixAutomaton::has_room_for_token() const {
  // One token adds at most two states (the new one and a clone).  Unbounded
  // automata still stop before state ids overflow int32.
  const int64_t limit =
      max_states_ > 0 ? max_states_ : int64_t{std::numeric_limits<int32_t>::max()};
  return static_cast<int64_t>(num_states()) + 2 <= limit;
}

// The online construction step: append `token` at position i = |text|.
void SuffixAutomaton::add_token(int32_t token) {
  const auto pos = static_cast<int32_t>(text_.size());
  const int32_t cur = new_state(len_[last_] + 1, -1, pos, pos);

  // Every suffix of the old text that cannot be followed by `token` yet now
  // can, ending only here: point it at `cur`.
  int32_t p = last_;
  while (p != -1 && transitions_.find(p, token) == -1) {
    add_transition(p, token, cur);
    p = link_[p];
  }

  if (p == -1) {
    link_[cur] = 0;  // `token` never occurred before
  } else {
    const int32_t q = transitions_.find(p, token);
    if (len_[p] + 1 == len_[q]) {
      link_[cur] = q;  // q's class simply gains this end position
    } else {
      // q holds strings longer than len[p]+1 that do NOT end here.  Split off
      // the shorter ones (which do) into a clone with q's transitions.
      const int32_t clone = new_state(len_[p] + 1, link_[q], first_end_[q], recent_end_[q]);
      for (int32_t e = edge_head_[q]; e != -1; e = edge_next_[e]) {
        const int32_t t = edge_token_[e];
        add_transition(clone, t, transitions_.find(q, t));
      }
      // Redirect the suffixes of the old text that reached q via `token`.
      for (; p != -1; p = link_[p]) {
        int32_t* target = transitions_.find_mutable(p, token);
        if (*target != q) break;
        *target = clone;
      }
      link_[q] = clone;
      link_[cur] = clone;
    }
  }
  last_ = cur;
  text_.push_back(token);
  counts_valid_ = false;

  // The longest suffix of the text that also ends earlier is link[cur].  Its
  // previous recent_end is the occurrence we copy from; then it becomes `pos`.
  const int32_t match = link_[cur];
  cursor_.state = match;
  cursor_.length = len_[match];
  cursor_.end = match == 0 ? -1 : recent_end_[match];
  if (match != 0) recent_end_[match] = pos;
}

void SuffixAutomaton::rebuild_from_recent_tokens() {
  // A SAM of w tokens has at most 2w states, so keeping max_states/4 tokens
  // leaves at least half of the budget for new tokens: rebuilds cost O(1)
  // amortised per token.
  const size_t window = static_cast<size_t>(
      (max_states_ > 0 ? max_states_ : int64_t{std::numeric_limits<int32_t>::max()}) / 4);
  const size_t keep = std::min(window, text_.size());
  std::vector<int32_t> recent(text_.end() - static_cast<std::ptrdiff_t>(keep), text_.end());
  reset_to_empty();
  for (int32_t token : recent) add_token(token);
  ++num_rebuilds_;
}

void SuffixAutomaton::extend(const int32_t* tokens, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    ++total_tokens_;
    if (!frozen_ && !has_room_for_token()) {
      if (policy_ == OverflowPolicy::kFreeze) {
        freeze();
      } else {
        rebuild_from_recent_tokens();
      }
    }
    if (frozen_) {
      step(cursor_, tokens[i]);
    } else {
      add_token(tokens[i]);
    }
  }
}

void SuffixAutomaton::freeze() {
  if (frozen_) return;
  frozen_ = true;
  compute_counts();  // read-only from now on: no lazy writes later
}

// ---------------------------------------------------------------------------
// Matching
// ---------------------------------------------------------------------------

void SuffixAutomaton::step(MatchCursor& cursor, int32_t token) const {
  // Standard matching: shorten the match along suffix links until it can be
  // followed by `token`.
  int32_t state = cursor.state;
  int32_t length = cursor.length;
  for (;;) {
    const int32_t next = transitions_.find(state, token);
    if (next != -1) {
      state = next;
      ++length;
      break;
    }
    if (state == 0) {
      length = 0;
      break;
    }
    state = link_[state];
    length = len_[state];
  }
  // A match that only ends at the text's last position has no continuation;
  // its suffix link's class has a strictly larger endpos set, so it does.
  const auto last_pos = static_cast<int32_t>(text_.size()) - 1;
  if (state != 0 && first_end_[state] >= last_pos) {
    state = link_[state];
    length = len_[state];
  }
  cursor.state = state;
  cursor.length = length;
  if (state == 0) {
    cursor.end = -1;
  } else {
    const int32_t recent = recent_end_[state];
    cursor.end = recent < last_pos ? recent : first_end_[state];
  }
}

Matcher::Matcher(const SuffixAutomaton& automaton) : automaton_(&automaton) {
  if (!automaton.frozen()) {
    throw std::invalid_argument(
        "a matcher needs a frozen (read-only) automaton: call freeze() or load() it");
  }
}

void Matcher::feed(const int32_t* tokens, size_t count) {
  for (size_t i = 0; i < count; ++i) automaton_->step(cursor_, tokens[i]);
}

// ---------------------------------------------------------------------------
// Occurrence counts and drafting
// ---------------------------------------------------------------------------

void SuffixAutomaton::compute_counts() const {
  // |endpos(v)| = number of prefix states (non-clones) in v's suffix-link
  // subtree.  A prefix state is the one created for position i: its longest
  // string is text[0..i], i.e. first_end == len - 1.  Children have larger len
  // than their link, so summing in decreasing len order is a valid order.
  const size_t states = num_states();
  counts_.assign(states, 0);
  std::vector<int32_t> bucket(text_.size() + 2, 0);
  for (size_t v = 0; v < states; ++v) {
    if (v != 0 && first_end_[v] == len_[v] - 1) counts_[v] = 1;
    ++bucket[len_[v] + 1];
  }
  for (size_t l = 1; l < bucket.size(); ++l) bucket[l] += bucket[l - 1];
  std::vector<int32_t> by_len(states);
  for (size_t v = 0; v < states; ++v) by_len[bucket[len_[v]]++] = static_cast<int32_t>(v);
  for (size_t i = states; i-- > 1;) {
    const int32_t v = by_len[i];
    counts_[link_[v]] += counts_[v];
  }
  counts_valid_ = true;
}

const std::vector<int32_t>& SuffixAutomaton::counts() const {
  if (!counts_valid_) compute_counts();
  return counts_;
}

std::vector<int32_t> SuffixAutomaton::draft(int k, int min_match, DraftStrategy strategy,
                                            double min_prob) const {
  return draft_from(cursor_, k, min_match, strategy, min_prob);
}

std::vector<int32_t> SuffixAutomaton::draft_from(const MatchCursor& cursor, int k,
                                                 int min_match, DraftStrategy strategy,
                                                 double min_prob) const {
  std::vector<int32_t> out;
  if (k <= 0 || cursor.length <= 0 || cursor.length < min_match) return out;
  if (cursor.state <= 0 || static_cast<size_t>(cursor.state) >= num_states()) return out;

  if (strategy == DraftStrategy::kFrequent) {
    const std::vector<int32_t>& count = counts();
    int32_t state = cursor.state;
    double prob = 1.0;
    out.reserve(static_cast<size_t>(k));
    while (static_cast<int>(out.size()) < k) {
      // Most frequent next token; ties go to the smaller token id.
      int32_t best_token = 0, best_state = -1, best_count = 0;
      for (int32_t e = edge_head_[state]; e != -1; e = edge_next_[e]) {
        const int32_t token = edge_token_[e];
        const int32_t next = transitions_.find(state, token);
        const int32_t c = count[next];
        if (c > best_count || (c == best_count && best_state != -1 && token < best_token)) {
          best_token = token;
          best_state = next;
          best_count = c;
        }
      }
      if (best_state == -1) break;
      prob *= static_cast<double>(best_count) / static_cast<double>(count[state]);
      if (prob < min_prob) break;
      out.push_back(best_token);
      state = best_state;
    }
    return out;
  }

  // Copy strategies: the tokens that followed one earlier occurrence.
  const int32_t end =
      strategy == DraftStrategy::kFirst ? first_end_[cursor.state] : cursor.end;
  if (end < 0) return out;
  const size_t begin = static_cast<size_t>(end) + 1;
  const size_t stop = std::min(text_.size(), begin + static_cast<size_t>(k));
  if (begin < stop) out.assign(text_.begin() + begin, text_.begin() + stop);
  return out;
}

int64_t SuffixAutomaton::count_occurrences(const int32_t* pattern, size_t length) const {
  if (length == 0) return static_cast<int64_t>(text_.size()) + 1;
  int32_t state = 0;
  for (size_t i = 0; i < length; ++i) {
    state = transitions_.find(state, pattern[i]);
    if (state == -1) return 0;
  }
  return counts()[state];
}

size_t SuffixAutomaton::memory_bytes() const {
  const size_t per_state = len_.capacity() + link_.capacity() + first_end_.capacity() +
                           recent_end_.capacity() + edge_head_.capacity() +
                           counts_.capacity();
  const size_t per_edge = edge_token_.capacity() + edge_next_.capacity();
  return sizeof(int32_t) * (per_state + per_edge + text_.capacity()) +
         transitions_.memory_bytes();
}

// ---------------------------------------------------------------------------
// Serialisation
// ---------------------------------------------------------------------------

std::vector<int32_t> SuffixAutomaton::sorted_tokens_of(int32_t state) const {
  std::vector<int32_t> tokens;
  for (int32_t e = edge_head_[state]; e != -1; e = edge_next_[e]) tokens.push_back(edge_token_[e]);
  std::sort(tokens.begin(), tokens.end());
  return tokens;
}

void SuffixAutomaton::save(const std::string& path) const {
  ByteWriter writer;
  writer.raw(kMagic, sizeof(kMagic));
  writer.scalar<uint32_t>(kFormatVersion);
  writer.scalar<uint32_t>(0);
  writer.scalar<uint64_t>(text_.size());
  writer.scalar<uint64_t>(num_states());
  writer.scalar<uint64_t>(num_transitions());
  writer.int32_array(text_);
  writer.int32_array(len_);
  writer.int32_array(link_);
  writer.int32_array(first_end_);
  writer.int32_array(recent_end_);
  // Canonical edge order makes files byte-identical across implementations.
  std::vector<int32_t> edges;
  edges.reserve(3 * num_transitions());
  for (size_t v = 0; v < num_states(); ++v) {
    const auto state = static_cast<int32_t>(v);
    for (int32_t token : sorted_tokens_of(state)) {
      edges.push_back(state);
      edges.push_back(token);
      edges.push_back(transitions_.find(state, token));
    }
  }
  writer.int32_array(edges);
  std::vector<unsigned char>& bytes = writer.bytes();
  writer.scalar<uint32_t>(crc32(bytes.data(), bytes.size()));

  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) throw IoError("cannot open '" + path + "' for writing");
  file.write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
  if (!file) throw IoError("failed writing '" + path + "'");
}

SuffixAutomaton SuffixAutomaton::load(const std::string& path) {
  std::ifstream file(path, std::ios::binary | std::ios::ate);
  if (!file) throw IoError("cannot open '" + path + "' for reading");
  const std::streamoff file_size = file.tellg();
  std::vector<unsigned char> bytes(static_cast<size_t>(std::max<std::streamoff>(file_size, 0)));
  file.seekg(0);
  file.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!file) throw IoError("failed reading '" + path + "'");

  const std::string where = "'" + path + "': ";
  if (bytes.size() < kHeaderBytes + kTrailerBytes ||
      std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    throw FormatError(where + "not a suffix automaton file (bad magic)");
  }
  ByteReader header(bytes.data() + sizeof(kMagic), kHeaderBytes - sizeof(kMagic));
  const auto version = header.scalar<uint32_t>();
  header.scalar<uint32_t>();  // reserved
  const auto n_tokens = header.scalar<uint64_t>();
  const auto n_states = header.scalar<uint64_t>();
  const auto n_edges = header.scalar<uint64_t>();
  if (version != kFormatVersion) {
    throw FormatError(where + "unsupported format version " + std::to_string(version) +
                      " (this build reads version " + std::to_string(kFormatVersion) + ")");
  }
  const uint64_t int32_limit = uint64_t(std::numeric_limits<int32_t>::max());
  if (n_tokens >= int32_limit || n_states >= int32_limit || n_edges >= int32_limit ||
      n_states == 0) {
    throw FormatError(where + "implausible sizes in header (file corrupt)");
  }
  const uint64_t expected =
      kHeaderBytes + 4 * (n_tokens + 4 * n_states + 3 * n_edges) + kTrailerBytes;
  if (expected != bytes.size()) {
    throw FormatError(where + "size mismatch: header implies " + std::to_string(expected) +
                      " bytes, file has " + std::to_string(bytes.size()) +
                      " (truncated or corrupt)");
  }
  ByteReader trailer(bytes.data() + bytes.size() - kTrailerBytes, kTrailerBytes);
  if (trailer.scalar<uint32_t>() != crc32(bytes.data(), bytes.size() - kTrailerBytes)) {
    throw FormatError(where + "checksum mismatch (file corrupt)");
  }

  ByteReader payload(bytes.data() + kHeaderBytes, bytes.size() - kHeaderBytes - kTrailerBytes);
  SuffixAutomaton sam;
  sam.text_ = payload.int32_array(n_tokens);
  sam.len_ = payload.int32_array(n_states);
  sam.link_ = payload.int32_array(n_states);
  sam.first_end_ = payload.int32_array(n_states);
  sam.recent_end_ = payload.int32_array(n_states);
  const std::vector<int32_t> edges = payload.int32_array(3 * n_edges);

  // Structural checks: a file that passes them cannot make us index out of
  // bounds, whatever its content.
  const auto n = static_cast<int32_t>(n_tokens);
  const auto s = static_cast<int32_t>(n_states);
  auto corrupt = [&where](const std::string& what) {
    return FormatError(where + "inconsistent automaton (" + what + ")");
  };
  if (sam.len_[0] != 0 || sam.link_[0] != -1) throw corrupt("root");
  for (int32_t v = 1; v < s; ++v) {
    const int32_t link = sam.link_[v], len = sam.len_[v];
    if (link < 0 || link >= s || len < 1 || len > n || sam.len_[link] >= len)
      throw corrupt("state " + std::to_string(v));
    if (sam.first_end_[v] < len - 1 || sam.first_end_[v] >= n ||
        sam.recent_end_[v] < len - 1 || sam.recent_end_[v] >= n)
      throw corrupt("end positions of state " + std::to_string(v));
    if (len == n && sam.first_end_[v] == n - 1) sam.last_ = v;
  }
  sam.edge_head_.assign(n_states, -1);
  for (size_t i = 0; i < n_edges; ++i) {
    const int32_t from = edges[3 * i], token = edges[3 * i + 1], to = edges[3 * i + 2];
    // Strictly increasing (from, token) also rules out duplicate transitions.
    const bool ordered = i == 0 || from > edges[3 * i - 3] ||
                         (from == edges[3 * i - 3] && token > edges[3 * i - 2]);
    if (!ordered || from < 0 || from >= s || to <= 0 || to >= s ||
        sam.len_[to] <= sam.len_[from])
      throw corrupt("edge " + std::to_string(i));
    sam.add_transition(from, token, to);
  }
  sam.total_tokens_ = n_tokens;
  sam.freeze();
  return sam;
}

}  // namespace sam
}  // namespace vllm_accel
