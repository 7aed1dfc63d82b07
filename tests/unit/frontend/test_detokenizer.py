"""IncrementalDetokenizer: streamed text equals a one-shot decode; stop strings cut cleanly.

Uses the tiny model's byte-level BPE tokenizer, where characters outside ASCII are split over
several byte tokens, so partial UTF-8 sequences really occur mid-stream.
"""

from __future__ import annotations

import random

import pytest

from frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer
from splitserve.models import resolve_model
from splitserve.tiny_model import SPECIAL_TOKENS

TEXTS = ["def f(x):\n    return x ** 2  # héllo, 世界 🙂\n", "naïve café — ﬁn 👩‍👩‍👧 ∑ ≥ ≤ 中文字符",
         "plain ascii only, nothing fancy", "🙂🙂🙂 emoji run 🚀🚀", "Ελληνικά и русский текст"]


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer(resolve_model("tiny"))


def stream(tok: ModelTokenizer, ids: list[int], stop: list[str], rng: random.Random | None = None):
    """Feed ids in random-sized groups; return the detokenizer and each released piece."""
    d = IncrementalDetokenizer(tok, stop)
    pieces, i = [], 0
    while i < len(ids) and not d.stopped:
        n = rng.randint(1, 4) if rng else 1
        pieces.append(d.add(ids[i:i + n]))
        i += n
    pieces.append(d.flush())
    return d, pieces


def test_multibyte_characters_split_over_tokens_stream_without_replacement_chars(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        _, pieces = stream(tok, ids, [])
        assert "".join(pieces) == text == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces), pieces
    # the tokenizer really does split these characters over several tokens
    ids = tok.encode("世界🙂", add_special_tokens=False)
    assert len(ids) > 3


def test_random_token_streams_equal_a_one_shot_decode(tok):
    rng = random.Random(0)
    for trial in range(400):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        _, pieces = stream(tok, ids, [], rng)
        assert "".join(pieces) == tok.decode(ids), (trial, ids)


def test_random_streams_of_text_tokens_equal_a_one_shot_decode(tok):
    rng = random.Random(1)
    for trial in range(200):
        text = "".join(rng.choice(TEXTS) for _ in range(3))
        ids = tok.encode(text)
        start = rng.randrange(len(ids))          # start anywhere, even inside a character
        ids = ids[start:start + rng.randint(1, 40)]
        _, pieces = stream(tok, ids, [], rng)
        assert "".join(pieces) == tok.decode(ids), (trial, ids)


def test_special_tokens_are_skipped(tok):
    ids = [0] + tok.encode("hello", add_special_tokens=False) + [3, 1]
    _, pieces = stream(tok, ids, [])
    assert "".join(pieces) == "hello"
    assert not any(s in "".join(pieces) for s in SPECIAL_TOKENS)


def check_stop(tok, ids: list[int], stop: list[str], rng=None) -> str:
    full = tok.decode(ids)
    cuts = [full.find(s) for s in stop if s in full]
    expect = full[:min(cuts)] if cuts else full
    d, pieces = stream(tok, ids, stop, rng)
    out = "".join(pieces)
    assert out == expect, (stop, out, expect)
    assert d.stopped == bool(cuts)
    released = ""
    for p in pieces:                 # never any part of a stop string, at any moment
        released += p
        assert expect.startswith(released)
    return out


def test_stop_string_cuts_before_the_stop_and_never_leaks_a_partial_stop(tok):
    text = "def hello():\n    return 'world'\n\nprint(hello())\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert check_stop(tok, ids, ["return"]) == "def hello():\n    "
    assert check_stop(tok, ids, ["\n\n"]) == "def hello():\n    return 'world'"
    assert check_stop(tok, ids, ["not there"]) == text
    assert check_stop(tok, ids, ["print", "world"]) == "def hello():\n    return '"   # the earliest wins
    assert check_stop(tok, ids, ["d"]) == ""


def test_stop_strings_spanning_token_boundaries(tok):
    rng = random.Random(2)
    checked = 0
    for text in TEXTS * 4:
        ids = tok.encode(text, add_special_tokens=False)
        # a stop string made of the end of one token's text and the start of the next ones
        bounds = [len(tok.decode(ids[:i])) for i in range(1, len(ids))]
        bounds = [b for b in bounds if 0 < b < len(text) - 1]
        b = rng.choice(bounds)
        stop = text[max(b - rng.randint(1, 3), 0):b + rng.randint(1, 4)]
        check_stop(tok, ids, [stop], rng)
        check_stop(tok, ids, [stop, "zzz-not-there"], rng)
        checked += 1
    assert checked == 4 * len(TEXTS)


def test_stop_strings_on_random_streams(tok):
    rng = random.Random(3)
    for trial in range(300):
        text = "".join(rng.choice(TEXTS) for _ in range(2))
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        i = rng.randrange(len(full))
        stop = full[i:i + rng.randint(1, 6)]
        check_stop(tok, ids, [stop], rng)


def test_nothing_is_released_after_a_stop(tok):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, ["beta"])
    out = "".join(d.add([t]) for t in ids) + d.flush()
    assert out == "alpha " and d.stopped
    assert d.add(ids) == "" and d.flush() == ""
