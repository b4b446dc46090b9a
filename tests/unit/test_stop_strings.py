"""Stop strings: found on generated text only, across token and step boundaries, cut (or kept) exactly, and never
leaked in part by a stream.  Token ids come from tokenizing text; no model runs."""

from __future__ import annotations

import random

import pytest

from tokenspout.engine.messages import EngineCoreOutput, EngineCoreRequest
from tokenspout.engine.output_processor import OutputProcessor
from tokenspout.engine.stop_checker import StopChecker
from tokenspout.outputs import CompletionOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams

KINDS = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]


def generate(tokenizer, text, *, stop, include=False, kind=RequestOutputKind.DELTA, per_step=1, min_tokens=0,
             prompt="Prompt:"):
    """Feeds the tokens of `text` as engine outputs; returns (outputs, processor, token ids, reqs_to_abort)."""
    op = OutputProcessor(tokenizer)
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, output_kind=kind, min_tokens=min_tokens,
                            max_tokens=None)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    op.add_request(EngineCoreRequest("r", prompt_ids, params), prompt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    outputs, aborts = [], []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        res = op.process_outputs([EngineCoreOutput("r", ids[i:i + per_step], finish_reason="length" if last else None)])
        outputs += res.request_outputs
        aborts += res.reqs_to_abort
        if not op.has_unfinished_requests():
            break
    return outputs, op, ids, aborts


def final(outputs, kind=RequestOutputKind.DELTA):
    """The finished choice as a user sees it: for DELTA streams, every chunk concatenated."""
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    last = outputs[-1].outputs[0]
    if kind != RequestOutputKind.DELTA:
        return last
    return CompletionOutput(last.index, "".join(o.outputs[0].text for o in outputs),
                            [t for o in outputs for t in o.outputs[0].token_ids], finish_reason=last.finish_reason,
                            stop_reason=last.stop_reason)


def check_stream_never_leaks(outputs, kind, final_text):
    """Every streamed state is a prefix of the final text: no chunk carries text that is later cut away."""
    sent = ""
    for o in outputs:
        c = o.outputs[0]
        sent = sent + c.text if kind == RequestOutputKind.DELTA else c.text
        assert final_text.startswith(sent), (sent, final_text)
    assert sent == final_text


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_step", [1, 2, 5])
def test_stop_spanning_token_boundary(tokenizer, kind, per_step):
    # "lo wor" covers the end of "Hello" and the start of " world": two tokens.
    outputs, _, _, aborts = generate(tokenizer, "Hello world, and more text after it.", stop=["lo wor"],
                                     kind=kind, per_step=per_step)
    c = final(outputs, kind)
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hel", "stop", "lo wor")
    assert aborts == ["r"]
    check_stream_never_leaks(outputs, kind, "Hel")
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(tokenizer, include):
    for kind in KINDS:
        outputs, _, _, _ = generate(tokenizer, "The answer is 42. Done here.", stop=[". D"], include=include,
                                    kind=kind)
        c = final(outputs, kind)
        expected = "The answer is 42. D" if include else "The answer is 42"
        assert c.text == expected and c.stop_reason == ". D"
        check_stream_never_leaks(outputs, kind, expected)


@pytest.mark.parametrize("stops", [["ab", "abc"], ["abc", "ab"]])
def test_stop_that_is_a_prefix_of_another(tokenizer, stops):
    # Whatever the order, the one that ends first wins; the same with one token per step or all at once.
    for per_step in (1, 100):
        outputs, _, _, _ = generate(tokenizer, "xx abcdef yy", stop=stops, per_step=per_step)
        c = final(outputs)
        assert (c.text, c.stop_reason) == ("xx ", "ab")


def test_same_end_prefers_longer_match(tokenizer):
    outputs, _, _, _ = generate(tokenizer, "one two three four", stop=["three", "two three"], per_step=100)
    assert final(outputs).text == "one "
    assert final(outputs).stop_reason == "two three"


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_the_very_first_token(tokenizer, include):
    for kind in KINDS:
        outputs, _, ids, _ = generate(tokenizer, "Hello there friend", stop=["Hello"], include=include, kind=kind)
        c = final(outputs, kind)
        assert c.text == ("Hello" if include else "")
        assert c.token_ids == ids[:1]  # the stop token is kept, nothing after it
        assert c.finish_reason == "stop"
        check_stream_never_leaks(outputs, kind, c.text)


def test_prompt_is_never_searched(tokenizer):
    outputs, _, _, _ = generate(tokenizer, " and the rest", stop=["STOP"], prompt="STOP now")
    c = final(outputs)
    assert c.finish_reason == "length" and c.text == " and the rest"


def test_min_tokens_defers_stop_strings(tokenizer):
    # With min_tokens=3, a stop string that ends within the first 3 tokens does not count; a later one does.
    text = "stop here, stop again"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids[:1]) == "stop" and len(ids) >= 5
    outputs, _, _, _ = generate(tokenizer, text, stop=["stop"], min_tokens=3)
    c = final(outputs)
    assert (c.text, c.finish_reason) == ("stop here, ", "stop")
    outputs, _, _, _ = generate(tokenizer, text, stop=["stop"], min_tokens=0)
    assert final(outputs).text == ""


def test_unfinished_stream_holds_back_only_a_possible_stop_prefix(tokenizer):
    # Tokens: "Hello", " wor", " and", " more".  "wor" could still grow into "world!", so it waits; once " and"
    # rules that out it is released.  Nothing else is delayed.
    outputs, _, _, _ = generate(tokenizer, "Hello wor and more", stop=["world!"], kind=RequestOutputKind.CUMULATIVE)
    assert [o.outputs[0].text for o in outputs] == ["Hello", "Hello ", "Hello wor and", "Hello wor and more"]
    outputs, _, _, _ = generate(tokenizer, "Hello wor", stop=["world!"], kind=RequestOutputKind.DELTA)
    assert [o.outputs[0].text for o in outputs] == ["Hello", " wor"]  # finishing releases the held part
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_stop_checker_unit():
    sc = StopChecker(["END", "xyz"])
    assert sc.find("abc EN", 4) is None
    m = sc.find("abc END", 6)  # only "D" is new: the look-back finds the span
    assert (m.stop, m.start, m.end) == ("END", 4, 7)
    assert sc.truncate_to(m) == 4
    assert StopChecker(["END"], include_stop_str_in_output=True).truncate_to(m) == 7
    assert sc.find("END abc", 5) is None  # a match that ended before the new text is not new
    assert sc.holdback("abc EN") == 2
    assert sc.holdback("abc xy") == 2
    assert sc.holdback("abc E") == 1
    assert sc.holdback("abc") == 0
    assert StopChecker(["aaa"]).holdback("baa") == 2
    assert StopChecker(["END"], include_stop_str_in_output=True).holdback("abc EN") == 0
    with pytest.raises(ValueError):
        StopChecker([""])


def _held_reference(text: str, stops: list[str]) -> int:
    """The longest suffix of text that is a proper prefix of some stop string, by brute force."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)


def test_holdback_follows_a_growing_text_like_brute_force():
    """holdback() follows the text with an automaton per stop string (checked at every growth step, and for a text
    that does not extend the previous one); periodic strings over two letters are where borders matter."""
    rng = random.Random(7)
    for trial in range(3000):
        alpha = "ab" if trial % 2 else "abc "
        stops = ["".join(rng.choice(alpha) for _ in range(rng.randint(1, 24))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alpha) for _ in range(rng.randint(0, 50)))
        sc, cut = StopChecker(stops), 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 5))
            assert sc.holdback(text[:cut]) == _held_reference(text[:cut], stops), (text[:cut], stops)
        other = "".join(rng.choice(alpha) for _ in range(rng.randint(1, 30)))
        assert sc.holdback(other) == _held_reference(other, stops), (other, stops)


def test_long_stop_strings_are_bounded():
    from tokenspout.sampling_params import MAX_STOP_CHARS

    SamplingParams(stop=["x" * MAX_STOP_CHARS]).validate()
    with pytest.raises(ValueError, match=f"stop must be a list of non-empty strings of at most {MAX_STOP_CHARS} "
                                         f"characters, got 'a string of {MAX_STOP_CHARS + 1} characters'"):
        SamplingParams(stop=["ok", "x" * (MAX_STOP_CHARS + 1)]).validate()


def _reference(tokenizer, ids, stops, include, min_tokens):
    """Naive oracle: decode every prefix, look for any stop string ending in the newest token's text."""
    prev = ""
    for k in range(1, len(ids) + 1):
        cur = tokenizer.decode(ids[:k])
        if k > min_tokens:
            matches = []
            for s in stops:
                i = cur.find(s)
                while i >= 0:
                    if i + len(s) > len(prev):
                        matches.append((i + len(s), i, s))
                        break
                    i = cur.find(s, i + 1)
            if matches:
                end, start, s = min(matches)
                return cur[:end if include else start], s, k
        prev = cur
    return prev, None, len(ids)


def test_random_stop_strings_against_naive_oracle(tokenizer):
    rng = random.Random(99)
    words = ["a", "b", "ab", "ba", " a", " b", "c", "\n", " abc", "bb"]
    for trial in range(120):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(3, 25)))
        stops = list({text[i:i + rng.randrange(1, 5)] for i in (rng.randrange(len(text)) for _ in range(2))})
        stops = [s for s in stops if s] or ["zz"]
        if rng.random() < 0.3:
            stops.append("q" + stops[0])  # one that never matches but shares a suffix
        include = rng.random() < 0.5
        min_tokens = rng.choice([0, 0, 2])
        ids = tokenizer.encode(text, add_special_tokens=False)
        expected, stop_reason, n_tokens = _reference(tokenizer, ids, stops, include, min_tokens)
        for kind in KINDS:
            per_step = rng.choice([1, 2, 3, 7])
            outputs, op, _, _ = generate(tokenizer, text, stop=stops, include=include, kind=kind,
                                         per_step=per_step, min_tokens=min_tokens)
            c = final(outputs, kind)
            ctx = (text, stops, include, min_tokens, kind, per_step)
            assert c.text == expected, ctx
            assert c.stop_reason == stop_reason, ctx
            assert c.finish_reason == ("stop" if stop_reason else "length"), ctx
            assert c.token_ids == ids[:n_tokens], ctx
            check_stream_never_leaks(outputs, kind, expected)
            assert not op.has_unfinished_requests()
