"""Stop strings: find where an output must end, checking only the text a step added.

A stop string may straddle tokens, or sit inside one token, so the check runs on the
detokenized text, not on ids. Only the tail that can hold a new match is searched:

    output_text:  .............. | max_stop_len - 1 | new_char_count |
                                 ^ search_start: a match starting earlier would have ended
                                   before the new text, so an earlier step saw it already
"""

from __future__ import annotations


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Returns (matched stop string, length to truncate output_text to), or None.

    When several stop strings match, the one that starts first wins (ties go to the one
    listed first), since the output must end at the earliest stop.

    Args:
        output_text: the whole output text so far, including this step's new characters.
        new_char_count: how many characters at the end of output_text this step added.
        stop: the request's stop strings (non-empty strings).
        include_in_output: keep the matched stop string in the text (truncate after it)
            instead of cutting it off (truncate before it).
    """
    if not stop or new_char_count <= 0:
        return None
    max_stop_len = max(len(stop_str) for stop_str in stop)
    search_start = max(len(output_text) - new_char_count - max_stop_len + 1, 0)
    best: tuple[int, str] | None = None
    for stop_str in stop:
        stop_index = output_text.find(stop_str, search_start)
        if stop_index != -1 and (best is None or stop_index < best[0]):
            best = (stop_index, stop_str)
    if best is None:
        return None
    stop_index, stop_str = best
    return stop_str, stop_index + len(stop_str) if include_in_output else stop_index


def num_held_back_chars(stop: list[str] | None, include_in_output: bool) -> int:
    """How many trailing characters a stream must not send yet.

    With stop strings cut from the output, the last max_stop_len - 1 characters may be the
    start of a stop string that later tokens complete; once sent they could not be taken
    back. Send them when the request finishes without a match.

    Args:
        stop: the request's stop strings, or None.
        include_in_output: the request keeps matched stop strings in its text.
    """
    if not stop or include_in_output:
        return 0
    return max(len(stop_str) for stop_str in stop) - 1
