"""The filter language's C++ parser and compiler (kernels/csrc/filter_compiler.h) against references written here:
random filters built as ASTs, printed and parsed back, compiled, and their programs evaluated over a filter bank
agree with a brute-force evaluation of the AST over the items' feature lists; the Bloom hash with hashlib's BLAKE2b;
syntax errors' positions counted in characters, as Python's str counts them."""

import hashlib
import random

import pytest
import torch

from silverrec.bitmask import unpack_bits
from silverrec.errors import QueryError
from silverrec.filtering.bloom_hash import token_positions
from silverrec.filtering.filter_lang import MAX_LENGTH, And, FilterSyntaxError, Not, Or, Term, parse, to_string
from silverrec.filtering.filter_program import FilterPlan, compile_batch, compile_request
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.publish.bloom import BloomConfig, build_filter_bank


def blake2b_positions(feature: str, value: str, bits: int, hashes: int, seed: int) -> list[int]:
    """The documented hash (bloom_hash.py), with hashlib: u32 words of keyed, salted BLAKE2b digests mod M."""
    name = feature.encode()
    data = len(name).to_bytes(4, "little") + name + value.encode()
    out, block = [], 0
    while len(out) < hashes:
        digest = hashlib.blake2b(data, digest_size=64, key=seed.to_bytes(8, "little"),
                                 salt=block.to_bytes(16, "little")).digest()
        out += [int.from_bytes(digest[4 * j:4 * j + 4], "little") % bits for j in range(min(16, hashes - len(out)))]
        block += 1
    return out


@pytest.mark.parametrize("feature, value, bits, hashes, seed", [
    ("genre", "Drama", 1 << 20, 3, 0x5EED), ("f", "v", 64, 40, 1), ("", "", 7, 17, 1 << 63),
    ("géńre 名", "値" * 100, 1000, 5, (1 << 64) - 1),  # a token longer than a 128-byte block
    ("a", "b" * 119, 1 << 30, 16, 3), ("a", "b" * 120, 1 << 30, 16, 3),  # exactly one block with the key, and just over
])
def test_token_positions_are_keyed_blake2b(feature, value, bits, hashes, seed):
    assert token_positions(feature, value, bits, hashes, seed) == blake2b_positions(feature, value, bits, hashes, seed)


def test_token_positions_refuse_bad_sizes():
    with pytest.raises(ValueError, match="Bloom bits and hashes must be positive, got M=0, K=3"):
        token_positions("a", "b", 0, 3, 1)


# ------------------------------------------------------------------------------------ syntax errors


def excerpt(text: str, pos: int) -> str:
    """The documented error layout: up to 60 characters around the position, a caret under it."""
    lo = max(0, pos - 30)
    hi = min(len(text), lo + 60)
    prefix = "..." if lo > 0 else ""
    return f"\n  {prefix}{text[lo:hi]}{'...' if hi < len(text) else ''}\n  {' ' * (len(prefix) + pos - lo)}^"


@pytest.mark.parametrize("text, position, problem", [
    ("名前 = x", 0, "unexpected character '名'"),  # characters, not bytes
    ("'名前' = x ; y", 9, "unexpected character ';'"),
    ("a = 'x\u00e9' 'y\x85'", 9, "expected AND, OR or the end of the filter, found string 'y\\x85'"),
    ("a = b AND 'c\x00d' = e OR", 22, "expected a feature name, NOT or '(', found the end of the filter"),
    ("x" * 50 + " = y z", 55, "expected AND, OR or the end of the filter, found 'z'"),
    ("a IN ('p', \"q\", r", 17, "expected ',' or ')' in the IN list, found the end of the filter"),
    ("a = \"it's", 4, 'unterminated string starting with "'),
])
def test_syntax_errors_count_characters(text, position, problem):
    with pytest.raises(FilterSyntaxError) as e:
        parse(text)
    assert e.value.position == position
    assert str(e.value) == f"filter syntax error at position {position}: {problem}" + excerpt(text, position)


def test_a_filter_past_the_limit_is_refused_with_its_start():
    text = "a = b OR " * (MAX_LENGTH // 9 + 1)
    with pytest.raises(FilterSyntaxError) as e:
        parse(text)
    assert str(e.value) == (f"filter syntax error at position 0: filter is longer than {MAX_LENGTH} characters"
                            + excerpt(text[:80], 0))


def test_whitespace_is_pythons():
    assert parse("a\u3000=\u00a0b\u2028AND\x1cc\t!=\nd") == And((Term("a", ("b",)), Not(Term("c", ("d",)))))


# ------------------------------------------------------------------------------------ compile vs brute force

FEATURES = {
    "genre": [["Drama"], ["Comedy", "Drama"], [], ["Horror"], ["Comedy"], ["Drama", "Horror", "Comedy"],
              ["pt BR"], ["AND", "Drama"]] * 25,
    "lang": [["EN"], ["ES"], ["EN"], ["FR"], ["ES"], ["EN"], [], ["FR"]] * 25,
}
VALUES = {"genre": ["Drama", "Comedy", "Horror", "pt BR", "AND", "Western"], "lang": ["EN", "ES", "FR", "it's"]}


def random_ast(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.3:
        f = rng.choice(sorted(VALUES))
        return Term(f, tuple(rng.sample(VALUES[f], rng.randint(1, 3))))
    kind = rng.choice(["not", "and", "or"])
    if kind == "not":
        child = random_ast(rng, depth - 1)
        return Not(child) if not isinstance(child, Not) else child  # the printer writes NOT NOT as nested NOTs
    children = []
    for _ in range(rng.randint(2, 3)):
        c = random_ast(rng, depth - 1)
        children += list(c.children) if type(c).__name__ == kind.capitalize() else [c]  # the parser flattens a chain
    return And(tuple(children)) if kind == "and" else Or(tuple(children))


def brute_force(node, item: int) -> bool:
    if isinstance(node, Term):
        return any(v in FEATURES[node.feature][item] for v in node.values)
    if isinstance(node, Not):
        return not brute_force(node.child, item)
    results = [brute_force(c, item) for c in node.children]
    return all(results) if isinstance(node, And) else any(results)


@pytest.fixture(scope="module")
def bank():
    fwd = ForwardIndex.from_lists(FEATURES)
    bank, cfg = build_filter_bank(fwd, BloomConfig(bits=512, hashes=4))
    return bank, FilterPlan.from_config(cfg)


def passing(bank, ops, rows, n: int) -> torch.Tensor:
    mask = torch.ops.silverrec.bloom_filter(bank, ops, rows, torch.zeros(ops.shape[0], 1, dtype=torch.int64), bank.shape[1])
    return unpack_bits(mask[:, 0], n)


def test_random_filters_select_what_brute_force_selects(bank):
    bits, plan = bank
    rng = random.Random(7)
    n = len(FEATURES["genre"])
    asts = [random_ast(rng, 3) for _ in range(300)]
    texts = [to_string(a) for a in asts]
    for a, t in zip(asts, texts):
        assert parse(t) == a, t  # the parser reads what the printer wrote
    ops, rows, vops, vrows, _ = compile_request(texts, plan)
    want = torch.tensor([[brute_force(a, i) for i in range(n)] for a in asts])
    # the verify program is exact (every feature has value-code planes); the Bloom program never drops a match
    assert torch.equal(passing(bits, vops, vrows, n), want)
    bloom = passing(bits, ops, rows, n)
    assert not (want & ~bloom).any()


def test_batches_pad_programs_without_changing_them(bank):
    bits, plan = bank
    n = len(FEATURES["genre"])
    filters = ["genre = Drama", None, "NOT (lang IN (EN, FR) OR genre != Horror)", "lang = Klingon"]
    ops, rows = compile_batch(filters, plan, exact_positive=True)
    for b, f in enumerate(filters):  # each row alone, compiled from scratch, selects the same items
        o, r = compile_batch([f], plan, exact_positive=True, cache=False)
        assert torch.equal(passing(bits, o, r, n)[0], passing(bits, ops, rows, n)[b])
    want = [[brute_force(parse(f), i) if f else True for i in range(n)] for f in filters]
    assert torch.equal(passing(bits, ops, rows, n), torch.tensor(want))


def test_unknown_feature_and_wrong_type_are_query_errors(bank):
    _, plan = bank
    with pytest.raises(QueryError, match=r"^unknown feature 'génre' in filter at position 13; this snapshot can filter on "
                                         r"\['genre', 'lang'\]$"):
        compile_request(["lang = EN", "lang = EN OR 'génre' = Drama"], plan)
    with pytest.raises(QueryError, match="^filter must be a string, got int$"):
        compile_request(["lang = EN", 3], plan)
