"""Grammars with llguidance over the default model's tokenizer: compile (cached, off the caller's thread),
errors that name the problem, masks, eos at the end, resync, and constrained generation from random
logits through the real sampler (every output valid)."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import mlx.core as mx
import numpy as np
import pytest

from metrale.errors import InvalidStructuredOutputError, RequestRejectedError, StructuredOutputUnavailableError
from metrale.sampling import guided
from metrale.sampling.constraints import TokenConstraints
from metrale.sampling.guided import GrammarCompiler, require_llguidance
from metrale.sampling.sampler import Sampler
from metrale.sampling_params import SamplingParams
from metrale.structured_outputs import StructuredOutputs
from tests.metrale.text_helpers import load_tokenizer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}},
        "required": ["id", "tags"], "additionalProperties": False},
    "status": {"enum": ["active", "banned", "pending"]}}, "required": ["user", "status"], "additionalProperties": False}
LIST = {"type": "array", "items": {"type": "object",
                                   "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}},
                                   "required": ["x", "ok"], "additionalProperties": False},
        "minItems": 1, "maxItems": 3}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer.backend.to_str, tokenizer.vocab_size, tokenizer.eos_token_ids)
    yield compiler
    compiler.shutdown()


def test_compiles_on_its_own_thread_and_caches_by_constraint(compiler):
    spec = StructuredOutputs(json=PERSON)
    first = compiler.submit(spec)
    assert compiler.submit(StructuredOutputs(json=json.dumps(PERSON))) is first  # same key, same future
    compiled = first.result(timeout=30)
    assert compiled.spec == spec
    threads = set()
    compiler._pool.submit(lambda: threads.add(threading.current_thread().name)).result()
    assert threads == {"metrale-grammar_0"}
    assert asyncio.run(compiler.compile(spec)) is compiled


@pytest.mark.parametrize(("spec", "problem"), [
    ({"json": {"type": "foo"}}, "Invalid type: foo"),
    ({"json": {"$ref": "#/definitions/nope"}}, "nope"),
    ({"json": {"type": "string", "pattern": "(unclosed"}}, "unclosed group"),
    ({"json": False}, "matches nothing"),
    ({"regex": "(abc"}, "unclosed group"),
    ({"grammar": "start: foo"}, "unknown name"),
    ({"grammar": 'root ::= ( "yes" '}, "GBNF"),
])
def test_a_bad_constraint_names_its_problem(compiler, spec, problem):
    future = compiler.submit(StructuredOutputs(**spec))
    with pytest.raises(InvalidStructuredOutputError, match=re.escape(problem)) as error:
        future.result(timeout=30)
    assert str(error.value).startswith(f"structured_outputs.{next(iter(spec))}")
    assert error.value.field == "structured_outputs" and isinstance(error.value, RequestRejectedError)


def test_missing_extra_is_a_rejection_naming_it(compiler, monkeypatch):
    monkeypatch.setattr(guided, "llguidance_available", lambda: False)
    with pytest.raises(StructuredOutputUnavailableError, match=r"metrale\[structured\]") as error:
        require_llguidance()
    assert error.value.field == "structured_outputs" and isinstance(error.value, RequestRejectedError)
    with pytest.raises(StructuredOutputUnavailableError):
        compiler.submit(StructuredOutputs(regex="a+"))


def test_mask_allows_eos_only_when_the_grammar_may_end(compiler, tokenizer):
    matcher = compiler.submit(StructuredOutputs(regex=r"[0-9]{2,3}")).result(timeout=30).new_matcher()
    mask = np.zeros((1, compiler.mask_words), dtype=np.int32)
    eos = tokenizer.eos_token_ids[0]

    def allowed(token_id: int) -> bool:
        matcher.fill_bitmask(mask, 0)
        return bool((mask[0, token_id // 32] >> (token_id % 32)) & 1)

    digits = [tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    assert all(allowed(d) for d in digits) and not allowed(eos)
    assert matcher.accept(digits[4]) and matcher.accept(digits[2])
    assert allowed(eos) and not matcher.is_finished  # "42" may end or take a third digit
    assert matcher.accept(digits[7]) and matcher.is_finished  # "427": nothing but eos
    assert allowed(eos) and not allowed(digits[1])
    assert not matcher.accept(digits[1]) and "1" in matcher.error  # refused: a permanent error state


def test_regex_digits_are_ascii_and_resync_and_rollback_follow_the_output(compiler, tokenizer):
    compiled = compiler.submit(StructuredOutputs(regex=r"\d{3}-\d{4}")).result(timeout=30)
    matcher = compiled.new_matcher()
    arabic = tokenizer.encode("٣", add_special_tokens=False)
    assert not matcher.accept(arabic[0])
    other = compiled.new_matcher()
    ids = tokenizer.encode("555-12", add_special_tokens=False)
    assert other.resync(ids) and other.num_tokens == len(ids)
    assert other.rollback(2) and other.num_tokens == len(ids) - 2 and other.resync([])


def test_parallel_fill_equals_one_by_one(compiler, tokenizer, monkeypatch):
    compiled = [compiler.submit(StructuredOutputs(json=s)).result(timeout=30) for s in (PERSON, NESTED, LIST)]
    matchers = [c.new_matcher() for c in compiled for _ in range(4)]
    prefix = tokenizer.encode('{"', add_special_tokens=False)
    for m in matchers[:4]:
        assert m.resync(prefix)
    one = np.zeros((12, compiler.mask_words), dtype=np.int32)
    compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)][:3], one)  # below the threshold
    for i, m in enumerate(matchers[3:], start=3):
        m.fill_bitmask(one, i)
    monkeypatch.setattr(guided.os, "cpu_count", lambda: 8)
    par = np.zeros_like(one)
    compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], par)
    assert np.array_equal(one, par)


CASES = [({"json": PERSON}, PERSON), ({"json": NESTED}, NESTED), ({"json": LIST}, LIST),
         ({"json_object": True}, {"type": "object"}), ({"choice": ["yes", "no", "maybe so"]}, None),
         ({"regex": r"\d{3}-\d{4}"}, None), ({"grammar": 'start: "a" ("b" | "c")+ "."'}, None)]


def test_random_logits_through_the_sampler_always_give_valid_outputs(compiler, tokenizer):
    """Eight constrained rows and one free row per step, sampled at temperature 1 from random logits
    tilted towards closing characters (so free-form strings end), until every grammar is finished."""
    vocab = tokenizer.vocab_size
    sampler = Sampler(vocab, eos_token_ids=tokenizer.eos_token_ids, seed=0)
    constraints = TokenConstraints(vocab, compiler)
    tilt = np.zeros(vocab, dtype=np.float32)
    for text in ('"', "}", "]", ",", ".", "1"):
        tilt[tokenizer.encode(text, add_special_tokens=False)[0]] = 6.0

    rows = []
    for i, (spec, _schema) in enumerate(CASES + [({"json": PERSON}, PERSON)]):
        rows.append(_Row(f"c{i}", SamplingParams(temperature=1.0, seed=i, structured_outputs=spec)))
    rows.append(_Row("free", SamplingParams(temperature=1.0, seed=99)))
    finished: dict[str, list[int]] = {}
    rng = np.random.default_rng(0)
    for _step in range(300):
        live = [r for r in rows if r.request_id not in finished]
        if len(live) == 1:
            break
        x = (rng.standard_normal((len(live), vocab)) * 2 + tilt).astype(np.float32)
        masks = constraints.prepare(live)
        tokens = sampler.sample(mx.array(x), sampler.prepare(live, masks.bitmask)).token_ids
        outcome = constraints.accept(live, tokens, masks)
        assert not outcome.errors
        for row, token in zip(live, tokens):
            row.output_token_ids.append(token)
            if row.request_id in outcome.finished or (token in tokenizer.eos_token_ids and row.request_id != "free"):
                finished[row.request_id] = row.output_token_ids
    unfinished = [r.request_id for r in rows if r.request_id not in finished]
    assert len(finished) == len(CASES) + 1, f"unfinished: {unfinished}"
    for i, (spec, schema) in enumerate(CASES + [({"json": PERSON}, PERSON)]):
        ids = [t for t in finished[f"c{i}"] if t not in tokenizer.eos_token_ids]
        text = tokenizer.decode(ids)
        if schema is not None:
            jsonschema.validate(json.loads(text), schema)
        elif "choice" in spec:
            assert text in spec["choice"]
        elif "regex" in spec:
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
        else:
            assert re.fullmatch(r"a[bc]+\.", text), text
    constraints.forget(r.request_id for r in rows)
    assert constraints.num_tracked == 0


class _Row:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids = [1]
        self.output_token_ids: list[int] = []


CHAIN_PROBE = """
import llguidance
from llguidance import LLMatcher
from metrale.sampling.guided import GrammarCompiler, grammar_text
from metrale.structured_outputs import MAX_GRAMMAR_RULES, MAX_REFS, StructuredOutputs
from tests.metrale.test_structured_outputs import ref_chain, rule_chain
from tests.metrale.text_helpers import load_tokenizer

tokenizer = load_tokenizer()
compiler = GrammarCompiler(tokenizer.backend.to_str, tokenizer.vocab_size, tokenizer.eos_token_ids)
for spec in (StructuredOutputs(json=ref_chain(MAX_REFS)), StructuredOutputs(grammar=rule_chain(MAX_GRAMMAR_RULES))):
    compiler.submit(spec).result(timeout=60).new_matcher()
# past the bounds, on the compile thread: the chains that overflowed an 8 MiB stack, and 5x the bounds
for links in (5000, 5 * MAX_REFS):
    schema = LLMatcher.grammar_from_json_schema(ref_chain(links))
    grammar = llguidance.grammar_from("grammar", rule_chain(links))
    for text in (schema, grammar):
        assert compiler._pool.submit(LLMatcher.validate_grammar, text).result(timeout=60) == ""
print("compiled")
"""


def test_the_longest_chains_compile_on_the_compile_thread_with_room_to_spare():
    # in a child process: a stack overflow kills it (SIGSEGV), not the test run
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", CHAIN_PROBE], capture_output=True, text=True, timeout=110,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0 and result.stdout.strip() == "compiled", (result.returncode, result.stderr[-2000:])


def test_llguidance_row_limit_is_out_of_reach_of_the_largest_choice(compiler, tokenizer):
    from metrale.structured_outputs import MAX_CHOICES

    words = [f"choice {i}" for i in range(MAX_CHOICES)]
    matcher = compiler.submit(StructuredOutputs(choice=words)).result(timeout=60).new_matcher()
    mask = np.zeros((1, compiler.mask_words), dtype=np.int32)
    for token_id in tokenizer.encode(words[-1], add_special_tokens=False):
        matcher.fill_bitmask(mask, 0)
        assert matcher.accept(token_id), matcher.error
    assert matcher.is_finished


def test_the_widest_object_allowed_generates_past_the_row_limit(compiler, tokenizer):
    from metrale.structured_outputs import MAX_OPTIONAL_PROPERTIES
    from tests.metrale.test_structured_outputs import wide_object

    schema = {**wide_object(MAX_OPTIONAL_PROPERTIES, required=1000), "additionalProperties": False}
    matcher = compiler.submit(StructuredOutputs(json=schema)).result(timeout=60).new_matcher()
    mask = np.zeros((1, compiler.mask_words), dtype=np.int32)
    for token_id in tokenizer.encode('{"f0": "x", "f1": "y", "f2": "', add_special_tokens=False):
        matcher.fill_bitmask(mask, 0)
        assert matcher.accept(token_id), matcher.error


def test_the_cache_is_bounded_by_estimated_bytes(tokenizer):
    specs = [StructuredOutputs(json={**PERSON, "title": f"person {i}"}) for i in range(10)]
    budget = 4 * guided.estimated_bytes(specs[0])
    compiler = GrammarCompiler(tokenizer.backend.to_str, tokenizer.vocab_size, tokenizer.eos_token_ids,
                               cache_bytes=budget)
    try:
        for spec in specs:
            compiler.submit(spec)
            assert compiler.cache_used_bytes <= budget
        assert compiler.num_cached == 4  # the 4 most recent (the titles are the same length)
        assert compiler.submit(specs[-1]) is compiler.submit(specs[-1])
        huge = StructuredOutputs(json={**PERSON, "description": "x" * 10_000})
        compiler.submit(huge).result(timeout=60)  # alone over the budget: kept alone, until the next
        assert compiler.num_cached == 1 and compiler.cache_used_bytes == guided.estimated_bytes(huge)
    finally:
        compiler.shutdown()
