"""StructuredOutputs' bounds: what would crash or never work in llguidance is refused at construction,
by a cheap scan, with a ValueError naming the field and the bound."""

from __future__ import annotations

import pytest

from metrale.structured_outputs import (MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_GRAMMAR_RULES,
                                        MAX_OPTIONAL_PROPERTIES, MAX_REFS, StructuredOutputs)


def ref_chain(links: int) -> dict:
    """A schema whose root and $defs form a chain of `links` $refs (root -> d0 -> ... -> a string)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links - 1)}
    defs[f"d{links - 1}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(rules: int, gbnf: bool = False) -> str:
    """A grammar of `rules` rules, each the next one (start -> r1 -> ... -> "a")."""
    if gbnf:
        return "root ::= r1\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(1, rules - 1)) + f'r{rules - 1} ::= "a"\n'
    return "start: r1\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(1, rules - 1)) + f'r{rules - 1}: "a"\n'


def test_the_crashing_ref_chain_is_refused_and_the_longest_allowed_is_taken():
    # a 5,000-link chain (178 KB) made llguidance overflow its stack (SIGSEGV) while compiling
    with pytest.raises(ValueError, match=rf'structured_outputs.json must hold at most {MAX_REFS} "\$ref", got 5000'):
        StructuredOutputs(json=ref_chain(5000))
    assert StructuredOutputs(json=ref_chain(MAX_REFS)).json.count('"$ref"') == MAX_REFS


@pytest.mark.parametrize("gbnf", [False, True])
def test_the_crashing_rule_chain_is_refused_and_the_longest_allowed_is_taken(gbnf):
    with pytest.raises(ValueError, match=rf"structured_outputs.grammar must define at most {MAX_GRAMMAR_RULES} "
                                         r"rules, got 5000"):
        StructuredOutputs(grammar=rule_chain(5000, gbnf))
    StructuredOutputs(grammar=rule_chain(MAX_GRAMMAR_RULES, gbnf))


def test_rules_are_counted_at_line_starts_only():
    grammar = 'start: item+\nitem: "a:" | "b ::= c"\n    | NAME\nNAME.2: /[a-z]+/\n?opt: "x"\n'
    StructuredOutputs(grammar=grammar)  # 4 rules, whatever the strings hold
    many = "start: r0\n" + "".join(f'r{i}: "{"a:" * 3}"\n' for i in range(MAX_GRAMMAR_RULES))
    with pytest.raises(ValueError, match=f"got {MAX_GRAMMAR_RULES + 1}"):
        StructuredOutputs(grammar=many)


def test_an_inline_json_schema_in_a_grammar_counts_its_refs():
    refs = ",".join(f'"p{i}": {{"$ref": "#/$defs/x"}}' for i in range(MAX_REFS + 1))
    grammar = f'start: %json {{"properties": {{{refs}}}, "$defs": {{"x": {{"type": "string"}}}}}}\n'
    with pytest.raises(ValueError, match='structured_outputs.grammar must hold at most'):
        StructuredOutputs(grammar=grammar)


@pytest.mark.parametrize("kind", ["json", "grammar", "regex"])
def test_text_longer_than_the_bound_is_refused(kind):
    filler = "x" * MAX_CONSTRAINT_CHARS + "x"
    value = {"json": {"description": filler}, "grammar": f'start: "{filler}"', "regex": filler}[kind]
    with pytest.raises(ValueError, match=f"structured_outputs.{kind} must be at most {MAX_CONSTRAINT_CHARS} characters"):
        StructuredOutputs(**{kind: value})


def test_choices_are_bounded_in_number_and_in_total_length():
    # llguidance's rows hold 2,000 items: 2,000 choices compiled, then failed at their first token
    with pytest.raises(ValueError, match=f"structured_outputs.choice must hold at most {MAX_CHOICES} strings, got 2001"):
        StructuredOutputs(choice=[str(i) for i in range(2001)])
    assert len(StructuredOutputs(choice=[str(i) for i in range(MAX_CHOICES)]).choice) == MAX_CHOICES
    long = "y" * (MAX_CONSTRAINT_CHARS // 2 + 1)
    with pytest.raises(ValueError, match=f"at most {MAX_CONSTRAINT_CHARS} characters in all"):
        StructuredOutputs(choice=[long, long + "z"])


def wide_object(optional: int, required: int = 0) -> dict:
    names = [f"f{i}" for i in range(optional + required)]
    return {"type": "object", "properties": {name: {"type": "string"} for name in names}, "required": names[optional:]}


def test_optional_properties_of_one_object_are_bounded_wherever_it_sits():
    # 499 optional properties compiled, then failed at the second token (a 500): llguidance's row limit
    with pytest.raises(ValueError, match=f"at most {MAX_OPTIONAL_PROPERTIES} optional properties .*got 499"):
        StructuredOutputs(json=wide_object(499))
    nested = {"type": "array", "items": {"anyOf": [{"type": "null"}, {"$defs": {"x": wide_object(500)}}]}}
    with pytest.raises(ValueError, match="got 500"):
        StructuredOutputs(json=nested)
    StructuredOutputs(json=wide_object(MAX_OPTIONAL_PROPERTIES, required=3000))  # required ones cost nothing there
