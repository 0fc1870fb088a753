"""Stopping: EOS and length, and TextStream's UTF-8-safe, stop-aware incremental text."""

from __future__ import annotations

import random
import sys

import pytest

from model import stopping
from model.stopping import (
    EOS_TOKEN,
    LENGTH,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    StopMatcher,
    TextStream,
    check_stop_token,
)
from model.tokenizer import BPETokenizer, CharTokenizer

# --- check_stop_token ------------------------------------------------------------------------------------------


def test_check_stop_token_eos_first_then_length() -> None:
    assert check_stop_token(5, 1, 3, eos_id=9) == (False, None)
    assert check_stop_token(5, 3, 3, eos_id=9) == (True, LENGTH)
    assert check_stop_token(9, 1, 3, eos_id=9) == (True, EOS_TOKEN)
    assert check_stop_token(9, 3, 3, eos_id=9) == (True, EOS_TOKEN)  # EOS on the last allowed token: EOS
    assert check_stop_token(9, 2, 3, eos_id=None) == (False, None)  # no EOS in this vocabulary
    assert check_stop_token(9, 2, 3, eos_id=9, stop_at_eos=False) == (False, None)
    assert check_stop_token(9, 3, 3, eos_id=9, stop_at_eos=False) == (True, LENGTH)


# --- TextStream with GPT-2's byte-level BPE ----------------------------------------------------------------------

MIXED = "Hello 👋🏽 world! 日本語のテキスト, naïve café — 🎉🇫🇷 中文字符 done.\n"


def _stream(tok, ids: list[int], stop: tuple[str, ...] = (), skip: tuple[int, ...] = ()) -> tuple[list, TextStream]:
    """Push `ids` one at a time until the stream stops; the deltas (the last one from finish())."""
    stream = TextStream(tok, stop, skip_ids=skip)
    deltas = []
    for i in ids:
        deltas.append(stream.push(i))
        if stream.stopped_by is not None:
            break
    deltas.append(stream.finish())
    return deltas, stream


def test_bpe_splits_characters_across_tokens(gpt2_tok: BPETokenizer) -> None:
    """The premise of the next test: some single tokens of MIXED are not whole UTF-8 text."""
    ids = gpt2_tok.encode(MIXED)
    partial = 0
    for i in ids:
        try:
            gpt2_tok.decode_bytes([i]).decode("utf-8")
        except UnicodeDecodeError:
            partial += 1
    assert partial >= 4


def test_never_emits_a_partial_character(gpt2_tok: BPETokenizer) -> None:
    ids = gpt2_tok.encode(MIXED)
    deltas, stream = _stream(gpt2_tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == gpt2_tok.decode(ids) == MIXED == stream.text
    assert stream.stopped_by is None
    # every emitted prefix is a prefix of the text: characters come out whole and in order
    assert any(d == "" for d in deltas[:-1])  # some tokens held bytes back


def test_incomplete_bytes_at_the_end_become_a_replacement_character(gpt2_tok: BPETokenizer) -> None:
    ids = gpt2_tok.encode("ok 🎉")
    cut = next(n for n in range(len(ids), 0, -1) if not _valid_utf8(gpt2_tok.decode_bytes(ids[:n])))
    deltas, _ = _stream(gpt2_tok, ids[:cut])
    assert "".join(deltas[:-1]) == "ok "
    assert deltas[-1] == "\ufffd"


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_stop_string_across_token_boundaries_is_excluded(gpt2_tok: BPETokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = gpt2_tok.encode(text)
    assert [gpt2_tok.decode([i]) for i in ids[:3]] == ["The", " quick", " brown"]
    deltas, stream = _stream(gpt2_tok, ids, stop=("ck bro",))
    assert "".join(deltas) == stream.text == "The qui"
    assert stream.stopped_by == "ck bro"
    assert len(deltas) == 4  # stopped on " brown", the third token; then finish()
    assert deltas[1] == " qui"  # "ck" might start the stop string: held back
    # after a stop nothing more comes out
    assert stream.push(ids[5]) == "" and stream.finish() == ""


def test_stop_string_inside_one_token_and_the_earliest_wins(gpt2_tok: BPETokenizer) -> None:
    ids = gpt2_tok.encode("abc The quick brown fox")
    deltas, stream = _stream(gpt2_tok, ids, stop=("rown", "uic", "zzz"))
    assert "".join(deltas) == "abc The q"
    assert stream.stopped_by == "uic"


def test_held_back_text_is_released_when_it_is_not_a_stop(gpt2_tok: BPETokenizer) -> None:
    ids = gpt2_tok.encode("The quick brown fox jumps")
    deltas, stream = _stream(gpt2_tok, ids, stop=("fox!", "ickle"))
    pieces = [gpt2_tok.decode([i]) for i in ids]
    assert pieces == ["The", " quick", " brown", " fox", " jumps"]
    assert deltas[0] == "The"
    assert deltas[1] == " qu"  # "ick" might start "ickle"
    assert deltas[2] == "ick brown"  # ... it did not
    assert deltas[3] == " "  # "fox" might start "fox!"
    assert deltas[4] == "fox jumps"
    assert deltas[5] == ""
    assert stream.stopped_by is None


def test_held_back_text_is_released_at_the_end(gpt2_tok: BPETokenizer) -> None:
    ids = gpt2_tok.encode("I said: the end")
    deltas, stream = _stream(gpt2_tok, ids, stop=("the end.",))
    assert "the end" not in "".join(deltas[:-1])
    assert deltas[-1].endswith("the end")
    assert "".join(deltas) == "I said: the end"
    assert stream.stopped_by is None


def test_skip_ids_produce_no_text(gpt2_tok: BPETokenizer) -> None:
    eos = gpt2_tok.eos_id
    assert eos is not None
    ids = gpt2_tok.encode("hi there") + [eos]
    deltas, _ = _stream(gpt2_tok, ids, skip=(eos,))
    assert "".join(deltas) == "hi there"
    assert deltas[-2] == ""  # the EOS token itself


# --- property: deltas only ever extend the text, and add up to the reference answer -----------------------------

WORDS = ["the", "quick", "brown", " fox", "stop", "sto", "end", "ENDING", "日本", "語", "👋🏽", "🎉", "é", "naïve",
         "\n", " ", "  ", "!!", "==", "= ", "…", "中文", "xy", "yx", "ababab", "aba"]


def _reference(tok, ids: list[int], stop: tuple[str, ...]) -> tuple[str, str | None]:
    """What the stream must produce, computed from whole prefixes: the text up to the first stop string seen
    after any token (the earliest-starting one if several complete on the same token)."""
    for n in range(1, len(ids) + 1):
        text = tok.decode_bytes(ids[:n]).decode("utf-8", errors="ignore")
        hits = [(text.find(s), s) for s in stop if s in text]
        if hits:
            i, s = min(hits)
            return text[:i], s
    return tok.decode_bytes(ids).decode("utf-8", errors="replace"), None


def _random_stops(rng: random.Random, text: str) -> tuple[str, ...]:
    stops = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.4 and len(text) > 2:  # a piece of the text: a real stop
            i = rng.randrange(len(text) - 1)
            stops.append(text[i : i + rng.randint(1, 6)])
        elif kind < 0.8 and len(text) > 2:  # a piece of the text that then goes wrong: held back, released
            i = rng.randrange(len(text) - 1)
            stops.append(text[i : i + rng.randint(1, 5)] + rng.choice(["#", "~", "@@"]))
        else:
            stops.append(rng.choice(WORDS).strip() or "x")
    return tuple(stops)


def _check_property(tok, texts_and_stops) -> int:
    stopped = 0
    for text, stop in texts_and_stops:
        ids = tok.encode(text)
        want, want_stop = _reference(tok, ids, stop)
        stream = TextStream(tok, stop)
        out = ""
        for i in ids:
            delta = stream.push(i)
            assert "\ufffd" not in delta
            out += delta
            # never emitted, then retracted: what is out is always a prefix of the answer
            assert want.startswith(out), (text, stop, out, want)
            if stream.stopped_by is not None:
                break
        out += stream.finish()
        assert out == want == stream.text, (text, stop)
        assert stream.stopped_by == want_stop, (text, stop)
        stopped += want_stop is not None
    return stopped


def _cases(seed: int, n: int) -> list[tuple[str, tuple[str, ...]]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        text = "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 14)))
        cases.append((text, _random_stops(rng, text)))
    return cases


def test_stream_property_bpe(gpt2_tok: BPETokenizer) -> None:
    cases = _cases(seed=2024, n=400)
    stopped = _check_property(gpt2_tok, cases)
    assert 0.2 * len(cases) < stopped < 0.9 * len(cases)  # both outcomes are well exercised


def test_stream_property_char() -> None:
    cases = _cases(seed=7, n=400)
    tok = CharTokenizer.from_text("".join(WORDS) + "#~@x")
    stopped = _check_property(tok, cases)
    assert 0.2 * len(cases) < stopped < 0.9 * len(cases)


@pytest.mark.parametrize(
    ("text", "stop", "want"),
    [
        ("abcd", ("bcd", "c"), "ab"),  # "c" completes first, streaming never waits for a longer one
        ("aaab", ("aab",), "a"),  # overlapping partial matches
        ("xxababc", ("abc",), "xxab"),
        ("hello", ("hello",), ""),
        ("hello", ("o", "hello"), ""),  # both complete on the last character: the earliest start
        ("hello", ("lo!", "hel!"), "hello"),
    ],
)
def test_stream_char_cases(text: str, stop: tuple[str, ...], want: str) -> None:
    tok = CharTokenizer.from_text(text)
    deltas, stream = _stream(tok, tok.encode(text), stop)
    assert "".join(deltas) == want


def test_stream_property_many_overlapping_stop_strings() -> None:
    """Up to 16 stop strings over a two-letter alphabet: they overlap, nest and share prefixes and suffixes, which is
    what the matcher's failure links are for."""
    rng = random.Random(11)
    tok = CharTokenizer.from_text("ab")
    cases = []
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 40)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(3, 9))) for _ in range(rng.randint(1, 16)))
        cases.append((text, stops))
    stopped = _check_property(tok, cases)
    assert 0.2 * len(cases) < stopped < 0.9 * len(cases)


# --- the cost of stop strings: work per token does not grow with their number or length ---------------------------

ALPHABET = [chr(c) for c in range(32, 127)]


def _lines_run(stop: tuple[str, ...], text: str) -> tuple[int, TextStream]:
    """Push `text` one character a token; the number of lines of model/stopping.py executed by the pushes (not by
    building the stream), counted with a trace function: a measure of work that does not depend on timing."""
    tok = CharTokenizer(ALPHABET)
    stream = TextStream(tok, stop)
    ids = tok.encode(text)
    lines = 0

    def local(frame, event: str, arg):  # noqa: ANN001, ANN202
        nonlocal lines
        lines += event == "line"
        return local

    def on_call(frame, event: str, arg):  # noqa: ANN001, ANN202
        return local if frame.f_code.co_filename == stopping.__file__ else None

    previous = sys.gettrace()  # a coverage tool's, say
    sys.settrace(on_call)
    try:
        for i in ids:
            stream.push(i)
    finally:
        sys.settrace(previous)
    assert stream.stopped_by is None  # none of these stop strings occurs: every token is matched against all
    return lines, stream


def _long_stop_cases() -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(text, one short stop string, MAX_STOP_STRINGS stop strings of MAX_STOP_CHARS characters): random ones, and
    ones the text keeps matching up to their last character (the most text held back, the most to re-check)."""
    rng = random.Random(5)
    text = "".join(rng.choice(ALPHABET) for _ in range(600))
    random_stops = tuple("".join(rng.choice(ALPHABET) for _ in range(MAX_STOP_CHARS)) for _ in range(MAX_STOP_STRINGS))
    deep = tuple("a" * (MAX_STOP_CHARS - 1 - k) + "b" for k in range(MAX_STOP_STRINGS))
    periodic = tuple(("ab" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 1 - k] + "#" for k in range(MAX_STOP_STRINGS))
    return [(text, ("~#",), random_stops), ("a" * 600, ("b#",), deep), ("ab" * 300, ("a#",), periodic)]


@pytest.mark.parametrize("case", range(3), ids=["random", "one letter", "periodic"])
def test_stop_matching_work_per_token_does_not_grow_with_the_stop_strings(case: int) -> None:
    """16 stop strings of the maximum length cost at most a small constant factor more work per token than one
    stop string of two characters (the old matcher, which re-checked every stop string against the held-back
    text on every token, did 16 x 128 times more)."""
    text, short, long = _long_stop_cases()[case]
    lines_short, _ = _lines_run(short, text)
    lines_long, stream = _lines_run(long, text)
    assert lines_long <= 1.5 * lines_short, (lines_long, lines_short)
    # the automaton: at most two transitions per character (each failure step gives back depth one forward
    # step added), however many and however long the stop strings
    assert stream.matcher is not None and stream.matcher.steps <= 2 * len(text)


def test_stop_matcher_holds_back_exactly_the_longest_possible_start() -> None:
    matcher = StopMatcher(("abcab", "bcx", "cabd"))
    state, start, k = matcher.scan(0, "zzabca", 0)
    assert (start, k) == (-1, -1) and matcher.depth[state] == 4  # "abca": a prefix of "abcab"
    state, start, k = matcher.scan(state, "bd", 6)
    assert (start, matcher.stop[k]) == (2, "abcab")  # "abcab" (from 2) ends before "cabd" (from 4) could
