"""check_stop_strings on plain strings: the search window, truncation, several stop strings."""

from __future__ import annotations

from kvserve.services.api.serving.stop_strings import check_stop_strings, num_held_back_chars


def test_match_straddling_the_new_tail():
    text = "hello wor" + "ld!"
    assert check_stop_strings(text, 3, ["world"], include_in_output=False) == ("world", 6)
    assert check_stop_strings(text, 3, ["world"], include_in_output=True) == ("world", 11)


def test_match_that_ended_before_the_new_tail_is_not_searched():
    # "bc" ends two characters before the one new character: an earlier step saw it.
    assert check_stop_strings("abcxyz", 1, ["bc"], include_in_output=False) is None
    assert check_stop_strings("abcxyz", 4, ["bc"], include_in_output=False) == ("bc", 1)


def test_earliest_stop_string_wins():
    text = "say stop now"
    assert check_stop_strings(text, len(text), ["now", "stop"], False) == ("stop", 4)
    # Same start: the first listed wins, and include_in_output keeps exactly it.
    assert check_stop_strings("xabcd", 5, ["abc", "ab"], True) == ("abc", 4)
    assert check_stop_strings("xabcd", 5, ["ab", "abc"], True) == ("ab", 3)


def test_no_new_text_or_no_stop_strings():
    assert check_stop_strings("stop", 0, ["stop"], False) is None
    assert check_stop_strings("stop", 4, [], False) is None
    assert check_stop_strings("no match here", 5, ["stop"], False) is None


def test_num_held_back_chars():
    assert num_held_back_chars(["ab", "abcd"], include_in_output=False) == 3
    assert num_held_back_chars(["ab", "abcd"], include_in_output=True) == 0
    assert num_held_back_chars(None, include_in_output=False) == 0
