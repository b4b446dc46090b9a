"""Incremental detokenization: generated token ids in, new text out, one token at a time.

Two implementations share one interface:

* `FastIncrementalDetokenizer` drives `tokenizers.decoders.DecodeStream`, which keeps a small sliding window of ids
  and decodes only that window per token, so the cost per token is constant and the sequence is never re-decoded.
* `SlowIncrementalDetokenizer` is the classic prefix_offset / read_offset method over `convert_ids_to_tokens` /
  `convert_tokens_to_string`, for tokenizers without a `tokenizers` backend (pure-Python / sentencepiece ones).

Both are primed with the tail of the prompt, so the first generated token decodes with the right leading space or
merge (a Metaspace decoder drops the leading space of the very first token of a sequence, for example).

Text semantics (transformers 5): the concatenated output equals `tokenizer.decode(output_ids, skip_special_tokens=…)`,
but for two things a stream cannot take back (vLLM's behaviour too): the first token keeps the leading space the
prompt gives it (a Metaspace decoder drops it when decoding the output alone), and where a byte-fallback decoder
re-renders a run of byte tokens ("é" already sent, then a stray continuation byte: `decode` shows U+FFFD for every
byte of the run) the "é" stays and the stray bytes are U+FFFD each.
transformers 5 no longer implements `spaces_between_special_tokens` in `decode`, so True (the default) means "what the
tokenizer's decoder does"; False additionally strips whatever separator the decoder puts in front of an added token
that directly follows another added token (only observable when special tokens are kept).

Neither path emits half a character: while the decoded window ends in U+FFFD (an incomplete UTF-8 byte sequence
split across byte-level / byte-fallback tokens) the text is held back.  `flush()` releases what is still held when
the request ends (e.g. max_tokens cut an emoji in half) as the decoder renders it, i.e. with U+FFFD, exactly as a
full `decode` would.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tokenspout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as left context: enough for any decoder's leading-space rule, and the window is extended (up to
# the maximum) until it starts on a character boundary.
_CONTEXT_MIN = 5
_CONTEXT_MAX = 24
# tokenizers raises this (as a generic Exception) when a decode no longer extends the previous one.
_INVALID_PREFIX = "Invalid prefix"


def backend_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a transformers tokenizer, or None for pure-Python tokenizers."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
    except (AttributeError, NotImplementedError, ValueError):
        backend = None
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _tokenizer_size(tokenizer: Any, backend: Tokenizer | None) -> int:
    if backend is not None:
        return backend.get_vocab_size(with_added_tokens=True)
    return len(tokenizer)


class TokenTexts:
    """`decoded_token` strings for logprobs: each id decoded on its own (special tokens kept), cached per id.

    A byte-level token that is only part of a UTF-8 character decodes to U+FFFD, as it does in vLLM and in HF's
    `decode([id])`.  Ids outside the tokenizer decode to "".
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = backend_tokenizer(tokenizer)
        self._size = _tokenizer_size(tokenizer, self._backend)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if not 0 <= token_id < self._size:
                return ""
            if self._backend is not None:
                text = self._backend.decode([token_id], skip_special_tokens=False)
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable bytes stand for themselves, the other 68 for the
    characters from U+0100 on, in byte order (what a ByteLevel pre-tokenizer writes into the vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in set(printable))})
    return chars


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token's own bytes, for OpenAI's logprobs `bytes` (cached per id): a byte-level BPE token's vocabulary
    string mapped back through GPT-2's byte alphabet, a byte-fallback token (`<0xE4>`) its byte, a SentencePiece
    piece with "▁" as a space; added tokens and other tokenizers: the bytes of the token's text.  A token that is
    only part of a UTF-8 character decodes to U+FFFD, whose bytes [239, 191, 189] had stood for every such token
    (vLLM's too), so a client could not rebuild the character from the bytes as OpenAI intends."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = backend_tokenizer(tokenizer)
        self._cache: dict[int, bytes] = {}
        self._kind = "text"
        self._added: set[int] = set()
        if self._backend is not None and self._backend.decoder is not None:
            spec = json.loads(self._backend.decoder.__getstate__())
            kinds = {d.get("type") for d in spec.get("decoders", [spec])}
            self._kind = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds \
                else "text"
            self._added = set(self._backend.get_added_tokens_decoder())
        self._chars = _byte_level_chars() if self._kind == "byte_level" else {}

    def __call__(self, token_id: int, text: str) -> bytes:
        """The bytes of `token_id`, whose text alone is `text`."""
        if self._kind == "text" or token_id in self._added:
            return text.encode("utf-8", errors="replace")
        out = self._cache.get(token_id)
        if out is None:
            out = self._bytes(token_id, text)
            self._cache[token_id] = out
        return out

    def _bytes(self, token_id: int, text: str) -> bytes:
        assert self._backend is not None
        piece = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if piece is None:
            return text.encode("utf-8", errors="replace")
        if self._kind == "byte_level":
            if all(c in self._chars for c in piece):
                return bytes(self._chars[c] for c in piece)
            return text.encode("utf-8", errors="replace")
        byte = _BYTE_TOKEN.fullmatch(piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode("utf-8")


class IncrementalDetokenizer(ABC):
    """Per-request incremental decoder.  `update()` / `step()` return only the new text; `output_text` is the sum."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool,
                 token_texts: TokenTexts | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Chunks, joined on demand: `str +=` on an attribute copies the whole text every token.
        self._chunks: list[str] = []
        self._joined = 0
        self._text = ""
        self._token_texts = token_texts
        self._backend = backend_tokenizer(tokenizer)
        self._size = _tokenizer_size(tokenizer, self._backend)
        self._warned_invalid = False
        # Only needed to strip decoder-inserted separators between adjacent added tokens (see module docstring).
        self._added: dict[int, str] | None = None
        self._last_added = False
        if not skip_special_tokens and not spaces_between_special_tokens:
            decoder = getattr(tokenizer, "added_tokens_decoder", None)
            if decoder is None and self._backend is not None:
                decoder = self._backend.get_added_tokens_decoder()
            self._added = {i: t.content for i, t in (decoder or {}).items()} or None

    @staticmethod
    def from_request(tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                     token_texts: TokenTexts | None = None, force_slow: bool = False) -> IncrementalDetokenizer:
        """The fast DecodeStream path when the tokenizer has a `tokenizers` backend, else the slow path."""
        cls = SlowIncrementalDetokenizer if force_slow or backend_tokenizer(tokenizer) is None \
            else FastIncrementalDetokenizer
        return cls(tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens,
                   token_texts)

    def update(self, new_token_ids: Iterable[int]) -> str:
        """Feeds several tokens; returns the text they completed."""
        return "".join(self.step(t) for t in new_token_ids)

    def step(self, token_id: int) -> str:
        """Feeds one token; returns the text it completed ("" while a character is still incomplete)."""
        if not 0 <= token_id < self._size:
            # A bad id from the engine must not kill the request (or the output loop): drop it from the text.
            if not self._warned_invalid:
                logger.warning("token id %r is outside the tokenizer [0, %d); it decodes to nothing", token_id,
                               self._size)
                self._warned_invalid = True
            return ""
        text = self._step(token_id)
        if self._added is not None:
            content = self._added.get(token_id)
            if content is not None and self._last_added and text:
                text = content
            self._last_added = content is not None
        if text:
            self._chunks.append(text)
        return text

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if self._joined != len(self._chunks):
            self._text = "".join(self._chunks)
            self._chunks = [self._text]
            self._joined = 1
        return self._text

    def flush(self) -> str:
        """Releases text still held back (an incomplete character at the end); call once, when the request ends."""
        text = self._flush()
        if text:
            self._chunks.append(text)
        return text

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.tokenizer)
        return self._token_texts(token_id)

    @abstractmethod
    def _step(self, token_id: int) -> str: ...

    @abstractmethod
    def _flush(self) -> str: ...


def _clean_tail(ids: Sequence[int], decode: Any) -> list[int]:
    """A short tail of `ids` that starts and ends on character boundaries: the left context for decoding what
    follows it.

    The start is moved back (at least _CONTEXT_MIN tokens, at most _CONTEXT_MAX) until the text does not begin
    mid-character.  A dangling incomplete character at the end (at most 4 byte tokens) is dropped: its bytes belong
    to the prompt, and a generated token that completes it must not pull prompt text into the output (the output
    decodes the way `decode(output_ids)` does, with U+FFFD for the orphaned continuation bytes).
    """
    end = len(ids)
    while end > 0 and len(ids) - end < 4 and decode(list(ids[max(0, end - 4):end])).endswith(REPLACEMENT_CHAR):
        end -= 1
    ids = ids[:end]
    if len(ids) <= _CONTEXT_MIN:
        return list(ids)
    for n in range(_CONTEXT_MIN, min(_CONTEXT_MAX, len(ids)) + 1):
        tail = list(ids[-n:])
        if not decode(tail).startswith(REPLACEMENT_CHAR):
            return tail
    return list(ids[-_CONTEXT_MIN:])


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, token_texts: TokenTexts | None = None) -> None:
        super().__init__(tokenizer, skip_special_tokens, spaces_between_special_tokens, token_texts)
        backend = self._backend
        assert backend is not None, "FastIncrementalDetokenizer needs a tokenizers backend"
        self._be: Tokenizer = backend
        self._ids: list[int] = []  # valid output ids fed so far
        self._emitted_upto = 0  # self._ids[:_emitted_upto] have produced all their text
        prompt_ctx = _clean_tail([t for t in prompt_token_ids if 0 <= t < self._size], self._decode)
        self._prompt_ctx = prompt_ctx
        self._stream = DecodeStream(ids=prompt_ctx, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._be.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _context(self) -> list[int]:
        """Ids whose text is already out: the left context for a fresh stream."""
        if self._emitted_upto == 0:
            return self._prompt_ctx
        upto = self._emitted_upto
        return _clean_tail(self._ids[max(0, upto - _CONTEXT_MAX - 4):upto], self._decode)

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        try:
            text = self._stream.step(self._be, token_id)
        except Exception as e:  # tokenizers raises a bare Exception for an invalid prefix
            if not (isinstance(e, (OverflowError, TypeError)) or str(e).startswith(_INVALID_PREFIX)):
                raise
            text = self._reset(e)
        if text is None:
            return ""
        self._emitted_upto = len(self._ids)
        return text

    def _contexts(self) -> Iterator[list[int]]:
        """Left contexts to replay the held ids after, best first: the emitted tail, then that tail without its
        last 1-4 ids, then the prompt's.  A byte-fallback decoder (Llama 2, Mistral: `<0xC3>` tokens) renders a run
        of byte tokens as one: an emitted "é" followed by a stray continuation byte becomes "\ufffd" x 3, so no
        context ending inside that run ever extends; one that ends before it decodes the held bytes on their own
        (U+FFFD each, as a separate decode would) instead of dropping them with the text after them."""
        ctx = self._context()
        yield ctx
        for cut in range(1, min(4, len(ctx)) + 1):
            # (one ending mid-character would make DecodeStream emit that character's bytes again, whole)
            if ctx[:-cut] and not self._decode(ctx[:-cut]).endswith(REPLACEMENT_CHAR):
                yield ctx[:-cut]
        yield self._prompt_ctx

    def _reset(self, error: Exception) -> str | None:
        """Re-primes a fresh stream with the already-emitted tail and replays the held ids.

        DecodeStream's window can end up in a state where the next decode no longer extends the previous one
        (decoders that rewrite earlier text, byte-fallback runs: see _contexts); a new stream has no such history.
        """
        logger.info("detokenizer stream reset after %s: %s", type(error).__name__, error)
        held = self._ids[self._emitted_upto:]
        for ctx in self._contexts():
            self._stream = DecodeStream(ids=ctx, skip_special_tokens=self.skip_special_tokens)
            try:
                return self._stream.step(self._be, held)
            except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exceptions: try the next context
                last = e
        # Give up on the held tokens' text rather than on the request.
        logger.warning("detokenizer replay failed (%s); dropping the text of %d token(s)", last, len(held))
        self._emitted_upto = len(self._ids)
        self._stream = DecodeStream(ids=self._context(), skip_special_tokens=self.skip_special_tokens)
        return None

    def _flush(self) -> str:
        held = self._ids[self._emitted_upto:]
        if not held:
            return ""
        text = ""
        for ctx in self._contexts():
            base, full = self._decode(ctx), self._decode(ctx + held)
            if full.startswith(base):
                text = full[len(base):]
                break
        self._emitted_upto = len(self._ids)
        self._stream = DecodeStream(ids=self._context(), skip_special_tokens=self.skip_special_tokens)
        return text


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """prefix_offset / read_offset over token strings: decode the window [prefix_offset:] and the already-emitted
    part [prefix_offset:read_offset]; the difference is new text once it no longer ends mid-character."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, token_texts: TokenTexts | None = None) -> None:
        super().__init__(tokenizer, skip_special_tokens, spaces_between_special_tokens, token_texts)
        # What tokenizers' decode(skip_special_tokens=True) drops: every added token flagged special.
        self._special: set[int] = set()
        if skip_special_tokens:
            self._special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
            self._special.update(tokenizer.all_special_ids)
        # Added tokens are rendered verbatim, never passed through the decoder (which could mangle them).
        self._added_vocab = set(tokenizer.get_added_vocab())
        prompt = [t for t in prompt_token_ids if 0 <= t < self._size and t not in self._special]
        ctx = _clean_tail(prompt, lambda ids: self._to_string(self._to_tokens(ids)))
        self._tokens: list[str] = self._to_tokens(ctx)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def _to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [t if t is not None else "" for t in self.tokenizer.convert_ids_to_tokens(list(ids))]

    def _to_string(self, tokens: Sequence[str]) -> str:
        parts: list[str] = []
        run: list[str] = []
        for tok in tokens:
            if tok in self._added_vocab:
                if run:
                    parts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(tok)
            else:
                run.append(tok)
        if run:
            parts.append(self.tokenizer.convert_tokens_to_string(run))
        return "".join(parts)

    def _step(self, token_id: int) -> str:
        if token_id in self._special:
            return ""
        self._tokens.append(self._to_tokens([token_id])[0])
        return self._emit(final=False)

    def _emit(self, final: bool) -> str:
        prefix_text = self._to_string(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._to_string(self._tokens[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text):]

    def _flush(self) -> str:
        if self._read_offset == len(self._tokens):
            return ""
        return self._emit(final=True)
