"""Prompt-lookup drafts: what followed the latest earlier occurrence of the longest matching
suffix, checked against a brute-force search after every extension."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mambastep.runtime.ngram_drafter import NgramDrafter


def brute(tokens, k, min_n, max_n):
    """The longest suffix of min_n..max_n tokens with an earlier occurrence that a token followed,
    its latest such occurrence; the up to k tokens after it."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        for end in range(L - 1, n - 1, -1):  # the occurrence tokens[end - n : end], followed by tokens[end]
            if tokens[end - n : end] == tokens[L - n :]:
                return tokens[end : end + k]
    return []


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=8),
       n=st.sampled_from([(1, 1), (2, 4), (3, 3), (1, 5)]), k=st.integers(1, 6))
def test_drafts_equal_a_brute_force_search(pieces, n, k):
    drafter = NgramDrafter(*n)
    tokens = []
    for piece in pieces:
        drafter.extend(piece)
        tokens += piece
        assert drafter.propose(k) == brute(tokens, k, *n)


def test_a_repeated_passage_is_drafted_whole_and_a_new_one_not_at_all():
    passage = [11, 12, 13, 14, 15, 16, 17, 18]
    drafter = NgramDrafter(2, 4)
    drafter.extend([1, 2] + passage + [3, 4] + passage[:3])  # the passage again, three tokens in
    assert drafter.propose(4) == [14, 15, 16, 17]
    drafter.extend([99, 98])
    assert drafter.propose(4) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(3, 2)
