"""Structured output: random walks through grammar masks always end in valid output (outside oracles: json +
jsonschema, re.fullmatch, Python's own parser), invalid specs raise ValueError, and the manager's async compile,
cache, batch bitmask, rollback, drafts and cleanup behave."""

from __future__ import annotations

import ast
import json
import re
import threading
import time
from collections.abc import Callable

import jsonschema
import numpy as np
import pytest
import torch

from tokenspout.sample.ops.masks import apply_grammar_bitmask
from tokenspout.sampling_params import StructuredOutputsParams as SOP
from tokenspout.structured_output import StructuredOutputManager, validate
from tokenspout.structured_output.backend import Grammar, StructuredOutputBackend, bitmask_width
from tokenspout.structured_output.llguidance_backend import GuidanceBackend

EOS = 2
NUM_WALKS = 30
MAX_WALK = 160

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": -2.5, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "role", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@(mail|post)\.(com|org)( #[0-9]{1,3})?"
CHOICES = ["yes", "no", "yes please", 'maybe "so"', "día ✓"]
# Arithmetic without spaces; NUMBER has no leading zero so Python's parser is an exact oracle.
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


@pytest.fixture(scope="module")
def backend(tokenizer) -> GuidanceBackend:
    return GuidanceBackend(tokenizer, len(tokenizer))


@pytest.fixture(scope="module")
def closer_weights(tokenizer) -> np.ndarray:
    """Walk weights favouring tokens that start with a closing character, so walks close their strings and
    brackets in a few steps instead of hundreds (any distribution over the allowed ids is a valid walk)."""
    toks = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return np.array([5000.0 if t.startswith('"') else 50.0 if t[:1] in (")", "]", "}") else 1.0 for t in toks])


def allowed_ids(mask_row: torch.Tensor, vocab: int) -> np.ndarray:
    """Ids whose bit is set, in the layout the sampler reads: bit t % 32 of word t // 32."""
    # Little-endian int32 words: byte b of word w holds tokens 32w + 8b ... 32w + 8b + 7, lowest bit first.
    bits = np.unpackbits(mask_row.contiguous().numpy().view(np.uint8), bitorder="little")[:vocab]
    return bits.nonzero()[0]


def walk(grammar: Grammar, tokenizer, weights: np.ndarray, rng: np.random.Generator,
         complete: Callable[[str], bool]) -> str:
    """Random tokens from the grammar's mask until EOS is drawn or the grammar terminates.  At every step, EOS
    must be allowed exactly when the text so far is a complete valid output (`complete`, an outside oracle).
    numpy, not torch: tiny torch ops stall for milliseconds on intra-op thread barriers on a busy host."""
    vocab = len(tokenizer)
    mask = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    ids: list[int] = []
    for _ in range(MAX_WALK):
        grammar.fill_bitmask(mask, 0)
        allowed = allowed_ids(mask[0], vocab)
        assert allowed.size > 0
        text = tokenizer.decode(ids)
        eos_ok = bool((allowed == EOS).any())
        assert eos_ok == complete(text), f"EOS allowed={eos_ok} after {text!r}"
        if grammar.is_terminated():
            assert allowed.tolist() == [EOS]
            return text
        if eos_ok and rng.random() < 0.3:
            return text
        cum = np.cumsum(weights[allowed])
        tok = int(allowed[min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), allowed.size - 1)])
        if tok == EOS:
            return text
        assert grammar.accept_tokens([tok])
        ids.append(tok)
    raise AssertionError(f"walk did not finish in {MAX_WALK} tokens: {tokenizer.decode(ids)!r}")


def run_walks(backend, tokenizer, weights, params: SOP, complete: Callable[[str], bool]) -> list[str]:
    template = backend.compile(params)
    rng = np.random.default_rng(1234)
    return [walk(template.fork(), tokenizer, weights, rng, complete) for _ in range(NUM_WALKS)]


def _json_ok(text: str, schema: dict | None) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    if schema is None:
        return isinstance(doc, dict)
    return jsonschema.Draft202012Validator(schema).is_valid(doc)


# -- random walks ----------------------------------------------------------------------------------------------


def test_walks_json_schema(backend, tokenizer, closer_weights):
    outs = run_walks(backend, tokenizer, closer_weights, SOP(json=json.dumps(SCHEMA)), lambda t: _json_ok(t, SCHEMA))
    for text in outs:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text))  # compact: no whitespace outside strings
    docs = [json.loads(t) for t in outs]
    assert len({d["role"] for d in docs}) > 1 and any("tags" in d for d in docs)  # the walks explore


def test_json_whitespace_default_and_override(backend, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for extra, spaced_ok in (({}, False), ({"x-guidance": {"whitespace_flexible": True}}, True)):
        g = backend.compile(SOP(json=json.dumps({**schema, **extra})))
        for text, ok in (('{"a":1}', True), ('{"a": 1}', spaced_ok)):
            ids = tokenizer.encode(text) + [EOS]
            assert (g.validate_tokens(ids) == len(ids)) == ok, (extra, text)


def test_walks_json_object(backend, tokenizer, closer_weights):
    outs = run_walks(backend, tokenizer, closer_weights, SOP(json_object=True), lambda t: _json_ok(t, None))
    assert all(isinstance(json.loads(t), dict) for t in outs)


def test_walks_regex(backend, tokenizer, closer_weights):
    outs = run_walks(backend, tokenizer, closer_weights, SOP(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None)
    assert all(re.fullmatch(REGEX, t) for t in outs)


def test_walks_choice(backend, tokenizer, closer_weights):
    outs = run_walks(backend, tokenizer, closer_weights, SOP(choice=CHOICES), lambda t: t in CHOICES)
    assert set(outs) <= set(CHOICES) and len(set(outs)) >= 3


def _arith_ok(text: str) -> bool:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    ok = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Constant)
    return re.fullmatch(r"[0-9+\-*/()]+", text) is not None and all(isinstance(n, ok) for n in ast.walk(tree))


def test_walks_lark(backend, tokenizer, closer_weights):
    outs = run_walks(backend, tokenizer, closer_weights, SOP(grammar=LARK), _arith_ok)
    assert all(_arith_ok(t) for t in outs) and any("(" in t for t in outs)


def test_gbnf_grammar(backend, tokenizer):
    g = backend.compile(SOP(grammar='root ::= "a" digit+\ndigit ::= [0-9]'))
    assert g.accept_tokens(tokenizer.encode("a12")) and not g.accept_tokens(tokenizer.encode("x"))


# -- invalid specs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params, words", [
    (SOP(json="not json"), ["structured_outputs.json", "not valid JSON"]),
    (SOP(json="[1, 2]"), ["structured_outputs.json", "JSON object"]),
    (SOP(json='{"type": "foo"}'), ["structured_outputs.json", "foo"]),
    (SOP(json='{"type": "string", "format": "weird"}'), ["format", "weird"]),
    (SOP(json='{"$ref": "#/nope"}'), ["/nope"]),
    (SOP(regex="(("), ["structured_outputs.regex", "unclosed group"]),
    (SOP(grammar="start: foo"), ["structured_outputs.grammar", "foo"]),
    (SOP(grammar='root ::= "a" ( '), ["structured_outputs.grammar", "GBNF"]),
])
def test_invalid_specs_raise(backend, params, words):
    for fn in (validate, backend.compile):
        with pytest.raises(ValueError) as info:
            fn(params)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_validate_accepts_valid_specs():
    for p in (SOP(json=json.dumps(SCHEMA)), SOP(regex=REGEX), SOP(choice=CHOICES), SOP(grammar=LARK),
              SOP(json_object=True)):
        validate(p)


# -- grammar semantics -----------------------------------------------------------------------------------------------


def test_accept_is_atomic_and_drafts_validate(backend, tokenizer):
    g = backend.compile(SOP(choice=["yes please", "no"]))
    yes, please, junk = tokenizer.encode("yes"), tokenizer.encode(" please"), tokenizer.encode("zz")
    assert g.validate_tokens(yes + please + [EOS]) == len(yes + please) + 1
    assert g.validate_tokens(yes + junk) == len(yes)
    assert not g.accept_tokens(yes + junk)  # refused: nothing consumed, grammar still usable
    assert g.accept_tokens(yes + please) and g.is_terminated()


def test_eos_after_the_grammar_stops(backend, tokenizer):
    """A grammar that stopped on its own allows only EOS; accepting that EOS works (llguidance's list APIs refuse
    it) and rollback counts it as a token."""
    g = backend.compile(SOP(choice=["no", "no way"]))
    no, way = tokenizer.encode("no"), tokenizer.encode(" way")
    assert g.validate_tokens(no + [EOS]) == len(no) + 1  # accepting, not stopped: EOS is llguidance's own
    assert g.accept_tokens(no + way) and g.is_terminated()
    assert g.validate_tokens([EOS, EOS]) == 2 and g.validate_tokens([EOS, 5]) == 1
    assert g.accept_tokens([EOS]) and not g.accept_tokens([5])
    g.rollback(1)  # the EOS
    assert g.is_terminated()
    g.rollback(len(way))
    assert not g.is_terminated() and g.validate_tokens(way) == len(way)
    fresh = backend.compile(SOP(choice=["no", "no way"]))
    assert fresh.validate_tokens(no + way + [EOS]) == len(no + way) + 1
    assert fresh.accept_tokens(no + way + [EOS])


def test_bitmask_drives_the_sampler(backend, tokenizer):
    """The sampler's apply_grammar_bitmask reads our layout: every surviving logit is an allowed token."""
    g = backend.compile(SOP(regex=REGEX))
    mask = torch.zeros(1, backend.width, dtype=torch.int32)
    g.fill_bitmask(mask, 0)
    x = torch.randn(1, len(tokenizer), generator=torch.Generator().manual_seed(0))
    apply_grammar_bitmask(x, mask)
    assert torch.isfinite(x[0]).nonzero().flatten().tolist() == allowed_ids(mask[0], len(tokenizer)).tolist()


# -- manager ---------------------------------------------------------------------------------------------------------


class _GatedBackend(StructuredOutputBackend):
    """Delegates to the real backend, but compiles block until the test opens the gate."""

    def __init__(self, inner: GuidanceBackend) -> None:
        super().__init__(inner.tokenizer, inner.vocab_size)
        self.inner, self.gate = inner, threading.Event()

    def compile(self, params: SOP) -> Grammar:
        assert self.gate.wait(10)
        return self.inner.compile(params)

    def fill_bitmasks(self, items, bitmask) -> None:
        self.inner.fill_bitmasks(items, bitmask)


def wait_ready(mgr: StructuredOutputManager, rid: str) -> None:
    deadline = time.monotonic() + 10
    while not mgr.is_ready(rid):
        assert time.monotonic() < deadline, "compile did not finish"
        time.sleep(0.001)


def fresh_mask(backend, params: SOP, prefix: list[int] = ()) -> torch.Tensor:
    g = backend.compile(params)
    assert g.accept_tokens(list(prefix))
    m = torch.zeros(1, backend.width, dtype=torch.int32)
    g.fill_bitmask(m, 0)
    return m[0]


def eos_allowed(row: torch.Tensor) -> bool:
    return bool((row[EOS // 32] >> (EOS % 32)) & 1)


def test_manager_async_compile_and_cache(backend):
    gated = _GatedBackend(backend)
    mgr = StructuredOutputManager(None, backend.vocab_size, backend=gated)
    schema = SOP(json=json.dumps(SCHEMA))
    mgr.submit("a", schema)
    mgr.submit("b", SOP(json=json.dumps(SCHEMA)))  # same spec while compiling: waits on the same compile
    assert not mgr.is_ready("a") and not mgr.is_ready("b") and mgr.error("a") is None
    with pytest.raises(RuntimeError, match="must not schedule"):
        mgr.grammar_bitmask(["a"])
    gated.gate.set()
    wait_ready(mgr, "a")
    wait_ready(mgr, "b")
    mgr.submit("c", schema)  # cache hit: ready at once, no compile
    assert mgr.is_ready("c") and mgr.num_compiles == 1
    # Each request has its own matcher state.
    assert mgr.accept("a", backend.tokenizer.encode('{"id":5'))
    masks = mgr.grammar_bitmask(["a", "b"])
    assert not torch.equal(masks[0], masks[1]) and torch.equal(masks[1], fresh_mask(backend, schema))
    mgr.submit("d", SOP(regex=REGEX))
    wait_ready(mgr, "d")
    assert mgr.num_compiles == 2
    mgr.shutdown()


def test_manager_errors_are_surfaced_and_cached(backend):
    mgr = StructuredOutputManager(None, backend.vocab_size, backend=backend)
    mgr.submit("bad", SOP(regex="(("))
    wait_ready(mgr, "bad")
    assert "unclosed group" in (mgr.error("bad") or "")
    mgr.submit("bad2", SOP(regex="(("))
    assert mgr.is_ready("bad2") and mgr.error("bad2") and mgr.num_compiles == 1
    with pytest.raises(RuntimeError):
        mgr.grammar_bitmask(["bad"])
    mgr.shutdown()


def test_manager_bitmask_rows_eos_rollback_remove(tokenizer):
    vocab = len(tokenizer) + 45  # logits padded past the tokenizer: those columns are never allowed
    mgr = StructuredOutputManager(tokenizer, vocab)  # the string backend, built lazily in the worker
    assert mgr.grammar_bitmask(["x", None]) is None  # no grammar anywhere: the sampler pays nothing
    mgr.submit("c", SOP(choice=["yes", "yes please"]))
    mgr.submit("r", SOP(regex=REGEX))
    wait_ready(mgr, "c")
    wait_ready(mgr, "r")
    assert mgr.grammar_bitmask(["x", None]) is None  # grammars exist, but not in this batch

    m = mgr.grammar_bitmask([None, "c", "plain", "r"]).clone()
    assert m.shape == (4, bitmask_width(vocab)) and m.dtype == torch.int32
    assert (m[0] == -1).all() and (m[2] == -1).all()
    for row in (1, 3):
        ids = allowed_ids(m[row], vocab)
        assert ids.size > 0 and int(ids.max()) < len(tokenizer)
    assert not eos_allowed(m[1])  # nothing generated yet: EOS masked

    yes, please = tokenizer.encode("yes"), tokenizer.encode(" please")
    assert mgr.accept("c", yes)
    after_yes = mgr.grammar_bitmask(["c"]).clone()
    assert eos_allowed(after_yes[0]) and not mgr.should_end("c")
    assert mgr.accept("c", please) and mgr.should_end("c")
    assert allowed_ids(mgr.grammar_bitmask(["c"])[0], vocab).tolist() == [EOS]
    mgr.rollback("c", len(please))
    assert torch.equal(mgr.grammar_bitmask(["c"])[0], after_yes[0]) and not mgr.should_end("c")
    mgr.rollback("c", len(yes))
    assert torch.equal(mgr.grammar_bitmask(["c"])[0], m[1])
    assert not mgr.accept("c", tokenizer.encode("nope"))  # refused, state untouched
    assert torch.equal(mgr.grammar_bitmask(["c"])[0], m[1])
    assert mgr.validate_tokens("c", yes + please + [5]) == len(yes + please)

    mgr.remove("c")
    mgr.remove("r")
    assert mgr.num_requests == 0 and mgr.is_ready("c") and mgr.accept("c", [5])
    assert mgr.grammar_bitmask(["c", "r"]) is None
    mgr.shutdown()


def test_manager_draft_rows(backend, tokenizer):
    mgr = StructuredOutputManager(None, backend.vocab_size, backend=backend)
    params = SOP(choice=["yes please", "no"])
    mgr.submit("s", params)
    wait_ready(mgr, "s")
    yes, please = tokenizer.encode("yes"), tokenizer.encode(" please")
    drafts = yes + please
    rows = ["s"] * (len(drafts) + 1) + [None]
    m = mgr.grammar_bitmask(rows, {"s": drafts}).clone()
    for k in range(len(drafts) + 1):
        assert torch.equal(m[k], fresh_mask(backend, params, drafts[:k])), k
    assert (m[-1] == -1).all()
    assert torch.equal(mgr.grammar_bitmask(["s"])[0], m[0])  # drafts were rolled back
    bad = [yes[0], tokenizer.encode("zz")[0], 5]
    m = mgr.grammar_bitmask(["s"] * 4, {"s": bad})
    assert torch.equal(m[1], fresh_mask(backend, params, bad[:1])) and (m[2:] == -1).all()
    mgr.shutdown()


def test_fill_16_rows_batched_matches_single(backend, tokenizer):
    """The batched (parallel) fill writes exactly what per-row fills write."""
    params = SOP(json=json.dumps(SCHEMA))
    prefixes = ['', '{"id":7', '{"id":7,"name":"Al', '{"id":7,"role":"user","address":{"zip":1']
    grammars = [backend.compile(params) for _ in range(16)]
    for i, g in enumerate(grammars):
        assert g.accept_tokens(tokenizer.encode(prefixes[i % 4]))
    batched = torch.zeros(16, backend.width, dtype=torch.int32)
    backend.fill_threads = 2
    try:
        backend.fill_bitmasks([(g, i) for i, g in enumerate(grammars)], batched)
    finally:
        backend.fill_threads = 0
    single = torch.zeros(16, backend.width, dtype=torch.int32)
    for i, g in enumerate(grammars):
        g.fill_bitmask(single, i)
    assert torch.equal(batched, single)
