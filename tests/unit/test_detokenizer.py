"""Incremental detokenization against the outside oracle `tokenizer.decode(output_ids)`, token by token, on both the
DecodeStream path and the slow prefix/read-offset path."""

from __future__ import annotations

import json
import random

import pytest

from tokenspout.engine.detokenizer import (
    REPLACEMENT_CHAR,
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    TokenTexts,
)
from tokenspout.sampling_params import SamplingParams

TEXTS = [
    "Hello world, plain ASCII.",
    " family 👨\u200d👩\u200d👧\u200d👦 and thumbs 👍🏽 and flags 🇯🇵🇫🇷",
    "中文字符和日本語のテキスト、한국어",
    "e\u0301 cafe\u0301 n\u0303 a\u0300\u0301\u0302 Z\u0351\u0352\u0353",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 🦀🦀🦀 then ascii",  # 4-byte characters split over several byte tokens
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "mixed: ¿Qué tal? Ünïcödé — “quotes” … 你好👋 ok",
    "special <|im_end|> inside <|im_start|>assistant\ntext<|endoftext|>",
]


def _params(skip: bool = True, spaces: bool = True) -> SamplingParams:
    return SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)


def _stream(tokenizer, prompt_ids, ids, skip=True, slow=False, spaces=True):
    det = IncrementalDetokenizer.from_request(tokenizer, prompt_ids, _params(skip, spaces), force_slow=slow)
    chunks = [det.step(t) for t in ids]
    chunks.append(det.flush())
    return det, chunks


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_full_decode(tokenizer, text, skip, slow):
    prompt = tokenizer.encode("Write something:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    det, chunks = _stream(tokenizer, prompt, ids, skip=skip, slow=slow)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(chunks) == expected
    assert det.output_text == expected
    for chunk in chunks:  # valid UTF-8 in, so no chunk may carry a replacement character (half a character)
        assert REPLACEMENT_CHAR not in chunk


def test_path_selection(tokenizer):
    assert isinstance(IncrementalDetokenizer.from_request(tokenizer, [], _params()), FastIncrementalDetokenizer)
    slow = IncrementalDetokenizer.from_request(tokenizer, [], _params(), force_slow=True)
    assert isinstance(slow, SlowIncrementalDetokenizer)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode(" 🦀", add_special_tokens=False)
    assert len(ids) >= 2, "the crab must span several byte tokens for this test to mean anything"
    for slow in (False, True):
        det = IncrementalDetokenizer.from_request(tokenizer, [], _params(), force_slow=slow)
        chunks = [det.step(t) for t in ids]
        assert chunks[:-1] == [""] * (len(ids) - 1)
        assert chunks[-1] == " 🦀"


@pytest.mark.parametrize("slow", [False, True])
def test_leading_space_after_prompt(tokenizer, slow):
    # Generated " world" after "Hello": the first token's leading space must survive.
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    ids = tokenizer.encode(" world and more", add_special_tokens=False)
    _, chunks = _stream(tokenizer, prompt, ids, slow=slow)
    assert chunks[0] == " world"
    assert "".join(chunks) == " world and more"


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_after_chat_template_prompt(tokenizer, slow, skip):
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": "hi 👋"}], tokenize=False,
                                                add_generation_prompt=True)
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    ids = tokenizer.encode("Sure! Here 🙂<|im_end|>", add_special_tokens=False)
    _, chunks = _stream(tokenizer, prompt, ids, skip=skip, slow=slow)
    assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert chunks[0] == "Sure"


@pytest.mark.parametrize("slow", [False, True])
def test_prompt_ending_mid_character(tokenizer, slow):
    # The prompt ends with the first byte(s) of an emoji; its dangling bytes must not leak into the output.
    emoji = tokenizer.encode(" 🦀", add_special_tokens=False)
    prompt = tokenizer.encode("Look:", add_special_tokens=False) + emoji[:-1]
    ids = tokenizer.encode(" then text", add_special_tokens=False)
    _, chunks = _stream(tokenizer, prompt, ids, slow=slow)
    assert "".join(chunks) == tokenizer.decode(ids) == " then text"


@pytest.mark.parametrize("slow", [False, True])
def test_flush_releases_a_truncated_character(tokenizer, slow):
    # max_tokens cut an emoji in half: nothing is emitted mid-character, the end renders like decode() does.
    ids = tokenizer.encode(" ok 🦀", add_special_tokens=False)[:-1]
    det = IncrementalDetokenizer.from_request(tokenizer, [], _params(), force_slow=slow)
    chunks = [det.step(t) for t in ids]
    assert all(REPLACEMENT_CHAR not in c for c in chunks)
    assert "".join(chunks) == " ok"
    tail = det.flush()
    assert REPLACEMENT_CHAR in tail
    assert det.output_text == tokenizer.decode(ids)
    assert det.flush() == ""


@pytest.mark.parametrize("slow", [False, True])
def test_update_with_many_tokens_equals_steps(tokenizer, slow):
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    det = IncrementalDetokenizer.from_request(tokenizer, [], _params(), force_slow=slow)
    pieces = [det.update(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(pieces) == tokenizer.decode(ids)


@pytest.mark.parametrize("slow", [False, True])
def test_invalid_token_ids_do_not_crash(tokenizer, slow):
    ids = tokenizer.encode(" before and after", add_special_tokens=False)
    det = IncrementalDetokenizer.from_request(tokenizer, [], _params(), force_slow=slow)
    text = det.update(ids[:2])
    for bad in (-1, len(tokenizer) + 5, 2**40):
        assert det.step(bad) == ""
    text += det.update(ids[2:]) + det.flush()
    assert text == " before and after"


class _RaisingStream:
    """Stands in for a DecodeStream whose state went bad."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def step(self, tokenizer, ids):
        raise self.error


@pytest.mark.parametrize("error", [Exception("Invalid prefix encountered"), OverflowError("out of range"),
                                   TypeError("StreamInput must be either an integer or a list of integers")])
def test_stream_errors_reset_and_continue(tokenizer, error):
    text = " a 👨\u200d👩\u200d👧 family and 中文"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Story:", add_special_tokens=False)
    for cut in range(1, len(ids)):  # break the stream at every position, mid-character ones included
        det = IncrementalDetokenizer.from_request(tokenizer, prompt, _params())
        out = det.update(ids[:cut])
        det._stream = _RaisingStream(error)  # the next step fails and must re-prime a fresh stream
        out += det.update(ids[cut:]) + det.flush()
        assert out == text, cut


def test_unrelated_errors_propagate(tokenizer):
    det = IncrementalDetokenizer.from_request(tokenizer, [], _params())
    det._stream = _RaisingStream(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        det.step(100)


@pytest.mark.parametrize("slow", [False, True])
def test_spaces_between_special_tokens_false(tokenizer, slow):
    # Byte-level decoding puts no separator between added tokens; False must not change that or the other text.
    ids = tokenizer.encode("<|im_start|><|im_end|>x <|im_end|><|endoftext|>", add_special_tokens=False)
    _, chunks = _stream(tokenizer, [], ids, skip=False, slow=slow, spaces=False)
    assert "".join(chunks) == "<|im_start|><|im_end|>x <|im_end|><|endoftext|>"


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_random_ids_match_full_decode(tokenizer, slow):
    """Arbitrary id sequences (invalid UTF-8 included) and prompts: streamed text == decode(ids)."""
    rng = random.Random(1234)
    vocab = len(tokenizer)
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        skip = rng.random() < 0.5
        _, chunks = _stream(tokenizer, prompt, ids, skip=skip, slow=slow)
        assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=skip), (prompt, ids, skip)


def test_byte_tokens_fuzz_never_emit_half_characters(tokenizer):
    """Valid text re-split into byte-level pieces at random: every chunk is whole characters."""
    rng = random.Random(7)
    alphabet = "aé中👍🏽\u200d👨🦀 \n"
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 20)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        for slow in (False, True):
            _, chunks = _stream(tokenizer, [], ids, slow=slow)
            assert "".join(chunks) == text
            assert all(REPLACEMENT_CHAR not in c for c in chunks)


def test_decode_token(tokenizer):
    texts = TokenTexts(tokenizer)
    hello = tokenizer.encode(" hello", add_special_tokens=False)
    assert len(hello) == 1
    assert texts(hello[0]) == " hello"
    assert texts(2) == "<|im_end|>"  # special tokens keep their text in logprobs
    assert texts(-1) == "" and texts(len(tokenizer) + 1) == ""
    byte_piece = tokenizer.encode(" 🦀", add_special_tokens=False)[0]
    assert texts(byte_piece) == tokenizer.decode([byte_piece])
    det = IncrementalDetokenizer.from_request(tokenizer, [], _params(), token_texts=texts)
    assert det.decode_token(hello[0]) == " hello"


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A tiny Llama-2-style tokenizer (BPE with byte fallback: `<0xC3>` tokens; Metaspace-like decoder), as
    Llama 2, Mistral v0.1 and Gemma ship: its ByteFallback decoder renders a whole run of byte tokens at once."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tk.train_from_iterator(["Hello world, hello again. The end.", "The capital of France is Paris."] * 20,
                           trainers.BpeTrainer(vocab_size=400, special_tokens=special))
    # the trainer made the byte tokens added (special) tokens: rebuilt from the vocabulary, they are ordinary ones
    model = json.loads(tk.to_str())["model"]
    out = Tokenizer(models.BPE(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token="<unk>",
                               byte_fallback=True))
    out.normalizer, out.decoder = tk.normalizer, tk.decoder
    out.add_special_tokens([AddedToken("</s>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=out, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("skip", [True, False])
def test_byte_fallback_run_broken_after_a_character_keeps_the_text(byte_fallback_tokenizer, skip):
    """An emitted "é" (<0xC3><0xA9>) followed by a stray continuation byte: the decoder re-renders the whole run as
    U+FFFD x 3, so the stream's text stopped being a prefix and the replay dropped the held tokens' text with the
    words after them ('éllo world' for 'é' + '\\ufffd' + ' hello world').  A stream cannot take back the "é": the
    stray byte is U+FFFD, and everything after it is the decoder's text."""
    tok = byte_fallback_tokenizer
    v = tok.get_vocab()
    b = [v["<0xC3>"], v["<0xA9>"]]
    words = tok.encode("hello world", add_special_tokens=False)  # ("▁hello", ...: the normalizer prepends "▁")
    prompt = tok.encode("Hello world", add_special_tokens=False)
    for out, want in [(b + [v["<0xA9>"]] + words, "é\ufffd hello world"),
                      (b + [v["<0xE4>"]] + words, "é\ufffd hello world"),  # a lead byte that never completes
                      (b + [v["<0xE4>"], v["<0xB8>"], v["<0xAD>"]] + words, "é中 hello world"),  # one valid run
                      (b + [v["<0xA9>"], v["</s>"]], "é\ufffd" + ("" if skip else "</s>")),
                      (b + [v["<0xA9>"]], "é\ufffd")]:  # the stray byte last: released by flush
        det, chunks = _stream(tok, prompt, out, skip=skip)
        assert "".join(chunks) == det.output_text == want, out
        # what a full decode shows, but for the run the stream had already shown part of
        assert tok.decode(out, skip_special_tokens=skip).endswith(want[2:].lstrip("\ufffd")), out


def test_token_bytes_rebuild_split_characters(tokenizer, byte_fallback_tokenizer):
    """OpenAI's logprobs `bytes`: each token's own bytes, so a client can rebuild a character split over tokens (the
    text of such a token alone is U+FFFD, whose bytes had stood for every one of them)."""
    from tokenspout.engine.detokenizer import TokenBytes

    text = "Hello 中 world 😀 café <|im_end|>"
    for tok, lead in ((tokenizer, ""), (byte_fallback_tokenizer, " ")):  # (a SentencePiece text starts with "▁")
        tb = TokenBytes(tok)
        ids = tok.encode(text, add_special_tokens=False)
        parts = [tb(i, tok.decode([i])) for i in ids]
        assert b"".join(parts) == (lead + text).encode(), parts
        partial = [p for p in parts if REPLACEMENT_CHAR in p.decode("utf-8", errors="replace")]
        assert partial and all(b"\xef\xbf\xbd" not in p for p in partial)  # real bytes, never U+FFFD's
    assert TokenBytes(byte_fallback_tokenizer)(byte_fallback_tokenizer.get_vocab()["<0xE4>"], "\ufffd") == b"\xe4"
    assert TokenBytes(object())(5, "\ufffd") == b"\xef\xbf\xbd"  # no tokenizers backend: the text's bytes
