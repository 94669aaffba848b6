"""Pure-Python suffix automaton: the fallback for ``vllm_accel._C_sam``.

Same classes, arguments, results, exceptions and file format as the C++
implementation in ``csrc/suffix_automaton/`` (the unit tests run both and
compare them), only slower: ~10-15x for bulk extend(), 2.5-5x for
one-token extend()+draft() loops, where call overhead dominates.  The C++
header has the full design notes; in short:

* A suffix automaton state stands for the substrings that end at exactly the
  same positions of the text ("endpos class").  ``len`` is the length of its
  longest string, ``link`` (suffix link) the state of the longest suffix in a
  different class, ``next`` its transitions (a dict: sparse, any vocabulary).
* ``_add_token`` is the standard online construction: one new state for the
  whole text, transitions added along the suffix-link chain, and at most one
  state split ("clone") to keep classes consistent.  Amortised O(1).
* The longest suffix that occurred earlier is ``link[last]`` while growing, and
  a cursor walked along transitions (``_step``) for frozen automata.
* ``first_end`` is the exact earliest end position of a class; ``recent_end`` a
  genuine, recent (not necessarily the latest) one, refreshed whenever the
  state is the matched state.  Occurrence counts are computed on demand.
"""

from __future__ import annotations

import operator
import os
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable

FORMAT_VERSION = 1
MIN_MAX_STATES = 16

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1
_MAGIC = b"VLLMASAM"
# magic, version, reserved, num_tokens, num_states, num_edges (little-endian)
_HEADER = struct.Struct("<8sIIQQQ")
_TRAILER = struct.Struct("<I")
_STRATEGIES = ("recent", "first", "frequent")
_POLICIES = ("rebuild", "freeze")


class SAMFormatError(ValueError):
    """A file that is not a valid suffix automaton file."""


def _to_tokens(tokens: Iterable[int]) -> list[int]:
    """Token ids as a list of ints; TypeError for non-integers, ValueError
    for ids outside int32 (the same errors the native bindings raise)."""
    if hasattr(tokens, "tolist"):  # numpy arrays, array.array, memoryview
        tokens = tokens.tolist()
    ids = list(map(operator.index, tokens))
    if ids and (min(ids) < _INT32_MIN or max(ids) > _INT32_MAX):
        bad = next(t for t in ids if not _INT32_MIN <= t <= _INT32_MAX)
        raise ValueError(f"token id out of int32 range: {bad}")
    return ids


def _check_strategy(strategy: str) -> None:
    if strategy not in _STRATEGIES:
        raise ValueError(
            f"unknown draft strategy '{strategy}' (expected 'recent', 'first' or 'frequent')"
        )


def _int32_bytes(values: list[int]) -> bytes:
    packed = array("i", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _int32_list(data: bytes) -> list[int]:
    packed = array("i")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


class SuffixAutomaton:
    """Suffix automaton over int32 token ids (pure Python).

    max_states: None for unbounded, else the most states the automaton may
    hold (>= 16).  on_full: what extend() does when one more token could exceed
    it: "rebuild" (default) rebuilds from the most recent max_states // 4
    tokens and keeps growing; "freeze" stops growing, later tokens only move
    the match.
    """

    def __init__(self, max_states: int | None = None, on_full: str = "rebuild") -> None:
        if max_states is not None:
            max_states = operator.index(max_states)
            if max_states <= 0:
                raise ValueError("max_states must be positive (or None for unbounded)")
            if max_states < MIN_MAX_STATES:
                raise ValueError(
                    f"max_states must be >= {MIN_MAX_STATES} (or None for unbounded)"
                )
        if on_full not in _POLICIES:
            raise ValueError(
                f"unknown on_full policy '{on_full}' (expected 'rebuild' or 'freeze')"
            )
        self._max_states = max_states or 0
        self._on_full = on_full
        # One token adds at most two states; unbounded still stops before the
        # int32 state ids of the native implementation would overflow.
        self._limit = self._max_states or _INT32_MAX
        self._frozen = False
        self._total_tokens = 0
        self._num_rebuilds = 0
        self._reset_to_empty()

    # ------------------------------------------------------------------ build

    def _reset_to_empty(self) -> None:
        self._len = [0]  # state 0 is the root (empty string)
        self._link = [-1]
        self._first = [-1]  # first_end
        self._recent = [-1]  # recent_end
        self._next: list[dict[int, int]] = [{}]
        self._text: list[int] = []
        self._last = 0
        self._cursor = (0, 0, -1)  # (state, length, end)
        self._counts: list[int] | None = None

    def _add_token(self, token: int) -> None:
        """The online construction step: append token at position |text|."""
        lens, links, nxt = self._len, self._link, self._next
        pos = len(self._text)
        cur = len(lens)
        lens.append(lens[self._last] + 1)
        links.append(-1)
        self._first.append(pos)
        self._recent.append(pos)
        nxt.append({})

        # Suffixes of the old text not yet followed by token now are, here only.
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = links[p]
        if p == -1:
            links[cur] = 0
        else:
            q = nxt[p][token]
            if lens[p] + 1 == lens[q]:
                links[cur] = q
            else:
                # Split q: its strings up to len[p]+1 also end here now.
                clone = len(lens)
                lens.append(lens[p] + 1)
                links.append(links[q])
                self._first.append(self._first[q])
                self._recent.append(self._recent[q])
                nxt.append(dict(nxt[q]))
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = links[p]
                links[q] = clone
                links[cur] = clone
        self._last = cur
        self._text.append(token)
        self._counts = None

        # Longest suffix that also ends earlier: link[cur]; copy from its
        # previous recent_end, then refresh recent_end to this position.
        match = links[cur]
        if match == 0:
            self._cursor = (0, 0, -1)
        else:
            self._cursor = (match, lens[match], self._recent[match])
            self._recent[match] = pos

    def _rebuild_from_recent_tokens(self) -> None:
        keep = min(self._limit // 4, len(self._text))
        recent = self._text[len(self._text) - keep :]
        self._reset_to_empty()
        for token in recent:
            self._add_token(token)
        self._num_rebuilds += 1

    def extend(self, tokens: Iterable[int]) -> None:
        """Append token ids (any iterable of ints or 1-D integer array)."""
        for token in _to_tokens(tokens):
            self._total_tokens += 1
            if not self._frozen and len(self._len) + 2 > self._limit:
                if self._on_full == "freeze":
                    self.freeze()
                else:
                    self._rebuild_from_recent_tokens()
            if self._frozen:
                self._cursor = self._step(self._cursor, token)
            else:
                self._add_token(token)

    def freeze(self) -> None:
        """Stop growing for good; later extend() calls only move the match."""
        if not self._frozen:
            self._frozen = True
            self._compute_counts()

    # ------------------------------------------------------------------ match

    def _step(self, cursor: tuple[int, int, int], token: int) -> tuple[int, int, int]:
        """Advance a match cursor by one token (read-only use)."""
        state, length, _ = cursor
        nxt, links, lens = self._next, self._link, self._len
        while True:
            target = nxt[state].get(token)
            if target is not None:
                state = target
                length += 1
                break
            if state == 0:
                length = 0
                break
            state = links[state]
            length = lens[state]
        # A match that only ends at the last text position has no continuation.
        last_pos = len(self._text) - 1
        if state != 0 and self._first[state] >= last_pos:
            state = links[state]
            length = lens[state]
        if state == 0:
            return (0, length, -1)
        recent = self._recent[state]
        return (state, length, recent if recent < last_pos else self._first[state])

    # ------------------------------------------------------------ counts/draft

    def _compute_counts(self) -> list[int]:
        """|endpos| per state: prefix states (first_end == len - 1) count one,
        summed up the suffix-link tree in decreasing len order."""
        lens, firsts, links = self._len, self._first, self._link
        counts = [0] * len(lens)
        buckets: list[list[int]] = [[] for _ in range(len(self._text) + 1)]
        for v in range(1, len(lens)):
            if firsts[v] == lens[v] - 1:
                counts[v] = 1
            buckets[lens[v]].append(v)
        for bucket in reversed(buckets):
            for v in bucket:
                counts[links[v]] += counts[v]
        self._counts = counts
        return counts

    def _draft_from(
        self, cursor: tuple[int, int, int], k: int, min_match: int, strategy: str,
        min_prob: float,
    ) -> list[int]:
        _check_strategy(strategy)
        state, length, end = cursor
        if k <= 0 or length <= 0 or length < min_match or state <= 0:
            return []
        if strategy == "frequent":
            counts = self._counts if self._counts is not None else self._compute_counts()
            out: list[int] = []
            prob = 1.0
            while len(out) < k:
                best = None  # (count, -token) maximised: most frequent, then smallest id
                for token, target in self._next[state].items():
                    key = (counts[target], -token)
                    if best is None or key > best[0]:
                        best = (key, token, target)
                if best is None:
                    break
                prob *= best[0][0] / counts[state]
                if prob < min_prob:
                    break
                out.append(best[1])
                state = best[2]
            return out
        if strategy == "first":
            end = self._first[state]
        if end < 0:
            return []
        return self._text[end + 1 : end + 1 + k]

    def draft(
        self, k: int, min_match: int = 1, strategy: str = "recent", min_prob: float = 0.0
    ) -> list[int]:
        """Up to k continuation tokens of the current match; [] when match_len
        < max(min_match, 1).  strategy: 'recent' (copy after a recent earlier
        occurrence, default), 'first' (copy after the earliest occurrence) or
        'frequent' (greedy most frequent next token; stops when the product of
        conditional frequencies drops below min_prob)."""
        return self._draft_from(self._cursor, k, min_match, strategy, min_prob)

    def count(self, pattern: Iterable[int]) -> int:
        """Number of occurrences of pattern in the automaton's text."""
        ids = _to_tokens(pattern)
        if not ids:
            return len(self._text) + 1
        state = 0
        for token in ids:
            state = self._next[state].get(token, -1)
            if state == -1:
                return 0
        counts = self._counts if self._counts is not None else self._compute_counts()
        return counts[state]

    def tokens(self) -> list[int]:
        """The token ids the automaton is built from."""
        return list(self._text)

    def memory_bytes(self) -> int:
        """Rough size of the Python containers (not comparable to native)."""
        size = sum(
            sys.getsizeof(x)
            for x in (self._len, self._link, self._first, self._recent, self._next, self._text)
        )
        return size + sum(sys.getsizeof(d) for d in self._next)

    def matcher(self) -> SuffixAutomatonMatcher:
        """A new SuffixAutomatonMatcher over this (frozen) automaton."""
        return SuffixAutomatonMatcher(self)

    # -------------------------------------------------------------- properties

    @property
    def match_len(self) -> int:
        return self._cursor[1]

    @property
    def match_end(self) -> int:
        return self._cursor[2]

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def num_states(self) -> int:
        return len(self._len)

    @property
    def num_transitions(self) -> int:
        return sum(len(d) for d in self._next)

    @property
    def num_tokens(self) -> int:
        return len(self._text)

    @property
    def total_tokens(self) -> int:
        return self._total_tokens

    @property
    def num_rebuilds(self) -> int:
        return self._num_rebuilds

    @property
    def max_states(self) -> int | None:
        return self._max_states or None

    @property
    def on_full(self) -> str:
        return self._on_full

    def __repr__(self) -> str:
        frozen = " frozen" if self._frozen else ""
        return (
            f"<SuffixAutomaton python tokens={len(self._text)} states={len(self._len)}"
            f" match_len={self._cursor[1]}{frozen}>"
        )

    # ------------------------------------------------------------------ files

    def save(self, path: str | os.PathLike) -> None:
        """Write the versioned binary format (see suffix_automaton.cpp)."""
        edges: list[int] = []
        for state, transitions in enumerate(self._next):
            for token in sorted(transitions):
                edges += (state, token, transitions[token])
        parts = [
            _HEADER.pack(_MAGIC, FORMAT_VERSION, 0, len(self._text), len(self._len),
                         len(edges) // 3),
            _int32_bytes(self._text),
            _int32_bytes(self._len),
            _int32_bytes(self._link),
            _int32_bytes(self._first),
            _int32_bytes(self._recent),
            _int32_bytes(edges),
        ]
        body = b"".join(parts)
        with open(os.fspath(path), "wb") as f:
            f.write(body + _TRAILER.pack(zlib.crc32(body)))

    @staticmethod
    def load(path: str | os.PathLike) -> SuffixAutomaton:
        """Load a saved automaton; the result is frozen."""
        path = os.fspath(path)
        with open(path, "rb") as f:
            data = f.read()
        where = f"'{path}': "
        if len(data) < _HEADER.size + _TRAILER.size or data[:8] != _MAGIC:
            raise SAMFormatError(where + "not a suffix automaton file (bad magic)")
        _, version, _, n_tokens, n_states, n_edges = _HEADER.unpack_from(data)
        if version != FORMAT_VERSION:
            raise SAMFormatError(
                where + f"unsupported format version {version} "
                f"(this build reads version {FORMAT_VERSION})"
            )
        if n_tokens >= _INT32_MAX or n_states >= _INT32_MAX or n_edges >= _INT32_MAX or (
            n_states == 0
        ):
            raise SAMFormatError(where + "implausible sizes in header (file corrupt)")
        expected = _HEADER.size + 4 * (n_tokens + 4 * n_states + 3 * n_edges) + _TRAILER.size
        if expected != len(data):
            raise SAMFormatError(
                where + f"size mismatch: header implies {expected} bytes, file has "
                f"{len(data)} (truncated or corrupt)"
            )
        (crc,) = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
        if crc != zlib.crc32(memoryview(data)[: len(data) - _TRAILER.size]):
            raise SAMFormatError(where + "checksum mismatch (file corrupt)")

        offset = _HEADER.size

        def take(count: int) -> list[int]:
            nonlocal offset
            values = _int32_list(data[offset : offset + 4 * count])
            offset += 4 * count
            return values

        sam = SuffixAutomaton()
        text, lens, links, firsts, recents = (
            take(n_tokens), take(n_states), take(n_states), take(n_states), take(n_states)
        )
        edges = take(3 * n_edges)
        _check_structure(where, n_tokens, lens, links, firsts, recents, edges)
        sam._text, sam._len, sam._link, sam._first, sam._recent = (
            text, lens, links, firsts, recents
        )
        sam._next = [{} for _ in range(n_states)]
        for i in range(0, len(edges), 3):
            sam._next[edges[i]][edges[i + 1]] = edges[i + 2]
        sam._last = 0
        for v in range(1, n_states):
            if lens[v] == n_tokens and firsts[v] == n_tokens - 1:
                sam._last = v
        sam._total_tokens = n_tokens
        sam.freeze()
        return sam


def _check_structure(
    where: str, n: int, lens: list[int], links: list[int], firsts: list[int],
    recents: list[int], edges: list[int],
) -> None:
    """Bounds checks so that no file can make the automaton index out of range."""

    def corrupt(what: str) -> SAMFormatError:
        return SAMFormatError(where + f"inconsistent automaton ({what})")

    s = len(lens)
    if lens[0] != 0 or links[0] != -1:
        raise corrupt("root")
    for v in range(1, s):
        link, length = links[v], lens[v]
        if link < 0 or link >= s or length < 1 or length > n or lens[link] >= length:
            raise corrupt(f"state {v}")
        if not (length - 1 <= firsts[v] < n and length - 1 <= recents[v] < n):
            raise corrupt(f"end positions of state {v}")
    for i in range(0, len(edges), 3):
        src, token, dst = edges[i], edges[i + 1], edges[i + 2]
        ordered = i == 0 or (src, token) > (edges[i - 3], edges[i - 2])
        if not ordered or not 0 <= src < s or not 0 < dst < s or lens[dst] <= lens[src]:
            raise corrupt(f"edge {i // 3}")


class SuffixAutomatonMatcher:
    """A match cursor over a frozen automaton, one per query sequence (e.g. one
    per request against a shared corpus automaton).  feed() is amortised O(1)
    per token; match_len is the longest suffix of the fed sequence that occurs
    in the automaton's text followed by at least one token."""

    def __init__(self, automaton: SuffixAutomaton) -> None:
        if not isinstance(automaton, SuffixAutomaton):
            raise TypeError("automaton must be a SuffixAutomaton of the same implementation")
        if not automaton.frozen:
            raise ValueError(
                "a matcher needs a frozen (read-only) automaton: call freeze() or load() it"
            )
        self._automaton = automaton
        self._cursor = (0, 0, -1)

    def reset(self) -> None:
        """Forget the fed sequence."""
        self._cursor = (0, 0, -1)

    def feed(self, tokens: Iterable[int]) -> None:
        """Append token ids to the query sequence."""
        step = self._automaton._step
        cursor = self._cursor
        for token in _to_tokens(tokens):
            cursor = step(cursor, token)
        self._cursor = cursor

    def draft(
        self, k: int, min_match: int = 1, strategy: str = "recent", min_prob: float = 0.0
    ) -> list[int]:
        """Same as SuffixAutomaton.draft, for this matcher's cursor."""
        return self._automaton._draft_from(self._cursor, k, min_match, strategy, min_prob)

    @property
    def match_len(self) -> int:
        return self._cursor[1]

    @property
    def match_end(self) -> int:
        return self._cursor[2]
