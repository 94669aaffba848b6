// Suffix automaton over 32-bit token ids, for model-free speculative decoding.
//
// A suffix automaton (SAM) of a text T is the smallest DFA that accepts every
// substring of T.  Each state stands for one "endpos class": the set of
// substrings that end at exactly the same positions of T.  A state stores
//   len        length of the longest substring in its class,
//   link       suffix link: the state of the longest suffix that lies in a
//              different class (its endpos set is a strict superset),
//   transitions token -> state.
// The strings of a state are the suffixes of its longest string with lengths in
// (len[link], len].  The online construction (Blumer et al. 1985) appends one
// token at a time in amortised O(1): it creates one state for the whole text,
// walks suffix links adding transitions, and splits ("clones") at most one
// state so that every state keeps a single endpos class.
//
// Speculative decoding asks one question after every appended token: what is
// the longest suffix of the sequence that occurred earlier, and what came after
// it?  While the automaton grows, that suffix is simply link[last] (the longest
// suffix of T with more than one end position), so the answer costs O(1).  For a
// read-only automaton (a corpus datastore, or a per-request automaton that hit
// its memory bound) a MatchCursor is walked along transitions instead, as in
// the classic "longest common substring" matching; it is also amortised O(1).
//
// Every state also stores
//   first_end  the smallest end position of its class (exact; clones inherit it),
//   recent_end an end position refreshed each time the state is the matched
//              state while growing.  It is always a genuine end position of the
//              class, and a recent one, but not guaranteed to be the largest:
//              keeping the exact maximum would need an update along the whole
//              suffix-link chain per token (O(n) per token on "aaaa...").
// Occurrence counts (|endpos|) are computed on demand in O(states) by a
// counting sort on len; they drive the "frequent" draft strategy.
//
// Transitions are sparse: one open-addressing hash table keyed by
// (state, token) answers lookups in O(1) whatever the vocabulary size, and a
// per-state singly linked list of tokens enumerates a state's transitions
// (needed for clones, counts-based drafting and serialisation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace vllm_accel {
namespace sam {

// A file that is not a valid suffix automaton file (bad magic, version,
// size, checksum or structure).
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file that could not be opened, read or written.
class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How draft() turns a match into continuation tokens.
enum class DraftStrategy {
  kRecent,    // copy the tokens after recent_end of the match (default)
  kFirst,     // copy the tokens after the earliest occurrence of the match
  kFrequent,  // greedily follow the most frequent next token (by |endpos|)
};

// What extend() does once another token could exceed max_states.
enum class OverflowPolicy {
  kRebuild,  // rebuild from the most recent max_states/4 tokens, keep growing
  kFreeze,   // stop growing; later tokens only move the match cursor
};

// The current match: the longest suffix of the fed sequence that occurs in the
// automaton's text ending before the text's last position (so that at least
// one token follows it).  `state` is the state of that suffix, `length` its
// length (0 = no match, state 0), `end` the end position whose continuation
// the "recent" strategy copies (-1 when length is 0).
struct MatchCursor {
  int32_t state = 0;
  int32_t length = 0;
  int32_t end = -1;
};

// Sparse transition function: (state, token) -> state, open addressing with
// linear probing over a power-of-two table kept at most half full.
class TransitionMap {
 public:
  TransitionMap();
  // Target of (state, token), or -1.
  int32_t find(int32_t state, int32_t token) const;
  // Pointer to the stored target of (state, token), or nullptr.  Invalidated
  // by the next insert().
  int32_t* find_mutable(int32_t state, int32_t token);
  // Adds a key that is not present yet.
  void insert(int32_t state, int32_t token, int32_t target);
  void clear();
  size_t size() const { return size_; }
  size_t memory_bytes() const;

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t pack(int32_t state, int32_t token) {
    return (uint64_t(uint32_t(state)) << 32) | uint32_t(token);
  }
  size_t slot_of(uint64_t key) const;  // slot holding key, or the empty slot
  void grow();

  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  size_t size_ = 0;
  size_t mask_ = 0;
};

class SuffixAutomaton {
 public:
  // max_states <= 0 means unbounded; otherwise it must be >= kMinMaxStates.
  explicit SuffixAutomaton(int64_t max_states = 0,
                           OverflowPolicy policy = OverflowPolicy::kRebuild);

  static constexpr int64_t kMinMaxStates = 16;
  static constexpr uint32_t kFormatVersion = 1;

  // Appends tokens.  While growing, the automaton's own cursor is the longest
  // earlier-occurring suffix (O(1) per token).  When frozen, tokens are not
  // stored; they only advance the cursor against the frozen text.
  void extend(const int32_t* tokens, size_t count);

  // Stops growth for good and computes occurrence counts, so the automaton can
  // be shared read-only by Matchers.
  void freeze();
  bool frozen() const { return frozen_; }

  const MatchCursor& cursor() const { return cursor_; }

  // Continuation of up to k tokens for `cursor` (the automaton's own cursor by
  // default).  Empty when cursor.length < max(min_match, 1).  min_prob only
  // applies to kFrequent: drafting stops once the product of the conditional
  // frequencies count(next)/count(current) would drop below it.
  std::vector<int32_t> draft(int k, int min_match, DraftStrategy strategy,
                             double min_prob) const;
  std::vector<int32_t> draft_from(const MatchCursor& cursor, int k,
                                  int min_match, DraftStrategy strategy,
                                  double min_prob) const;

  // Advances `cursor` by one token against the current text (read-only use).
  void step(MatchCursor& cursor, int32_t token) const;

  // Number of occurrences of `pattern` in the text (0 if absent; the empty
  // pattern occurs num_tokens()+1 times).
  int64_t count_occurrences(const int32_t* pattern, size_t length) const;

  void save(const std::string& path) const;
  // Loaded automata are frozen.
  static SuffixAutomaton load(const std::string& path);

  size_t num_states() const { return len_.size(); }
  size_t num_transitions() const { return transitions_.size(); }
  size_t num_tokens() const { return text_.size(); }
  int64_t total_tokens() const { return total_tokens_; }
  int64_t num_rebuilds() const { return num_rebuilds_; }
  int64_t max_states() const { return max_states_; }
  OverflowPolicy policy() const { return policy_; }
  const std::vector<int32_t>& tokens() const { return text_; }
  size_t memory_bytes() const;

 private:
  void reset_to_empty();
  int32_t new_state(int32_t len, int32_t link, int32_t first_end,
                    int32_t recent_end);
  void add_transition(int32_t from, int32_t token, int32_t to);
  void add_token(int32_t token);  // the online construction step
  void rebuild_from_recent_tokens();
  bool has_room_for_token() const;
  void compute_counts() const;
  const std::vector<int32_t>& counts() const;
  std::vector<int32_t> sorted_tokens_of(int32_t state) const;

  // Per-state arrays, indexed by state id (state 0 is the root).
  std::vector<int32_t> len_;
  std::vector<int32_t> link_;
  std::vector<int32_t> first_end_;
  std::vector<int32_t> recent_end_;
  std::vector<int32_t> edge_head_;  // first edge of the state's list, or -1
  // Per-edge arrays: the token of the edge and the next edge of its state.
  std::vector<int32_t> edge_token_;
  std::vector<int32_t> edge_next_;
  TransitionMap transitions_;

  std::vector<int32_t> text_;  // the tokens the automaton was built from
  int32_t last_ = 0;           // state of the whole text
  MatchCursor cursor_;
  bool frozen_ = false;
  int64_t max_states_ = 0;
  OverflowPolicy policy_ = OverflowPolicy::kRebuild;
  int64_t total_tokens_ = 0;
  int64_t num_rebuilds_ = 0;

  mutable std::vector<int32_t> counts_;
  mutable bool counts_valid_ = false;
};

// A match cursor over a frozen automaton, one per query sequence (e.g. one per
// request against a shared corpus automaton).  Holds a non-owning pointer: the
// automaton must outlive the matcher.
class Matcher {
 public:
  explicit Matcher(const SuffixAutomaton& automaton);
  void reset() { cursor_ = MatchCursor{}; }
  void feed(const int32_t* tokens, size_t count);
  const MatchCursor& cursor() const { return cursor_; }
  std::vector<int32_t> draft(int k, int min_match, DraftStrategy strategy,
                             double min_prob) const {
    return automaton_->draft_from(cursor_, k, min_match, strategy, min_prob);
  }
  const SuffixAutomaton& automaton() const { return *automaton_; }

 private:
  const SuffixAutomaton* automaton_;
  MatchCursor cursor_;
};

}  // namespace sam
}  // namespace vllm_accel
