"""Radix prefix cache: property tests of the tree, and engine-level guarantees (a hit gives the same
tokens as a miss, nothing leaks between requests after splits and evictions, a fan-out prefills its
shared prefix once)."""

from __future__ import annotations

import mlx.core as mx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallm_engine import Engine
from parallm_engine.kv.radix_cache import RadixCache

from .conftest import chat_ids

LAYERS = 2


def kv_for_tokens(tokens):
    """KV segments whose values *are* the token ids, so any stale or misplaced segment is visible."""

    def make(start, end):
        vals = mx.array([float(t) for t in tokens[start:end]], dtype=mx.float32).reshape(1, 1, end - start, 1)
        return [(vals * (layer + 1), -vals * (layer + 1)) for layer in range(LAYERS)]

    return make


def stored_paths(tree: RadixCache) -> set[tuple[int, ...]]:
    out = set()

    def walk(node, prefix):
        for child in node.children.values():
            path = prefix + child.tokens
            for k in range(len(prefix) + 1, len(path) + 1):
                out.add(path[:k])
            walk(child, path)

    walk(tree.root, ())
    return out


def check_invariants(tree: RadixCache):
    assert tree.total_bytes == tree.computed_bytes()
    stats = tree.stats()  # counters kept incrementally equal a recount
    assert (stats["nodes"], stats["tokens"]) == (tree.num_nodes(), tree.num_tokens())
    for node in tree._iter_nodes():
        assert node.kv is not None and all(k.shape[2] == len(node.tokens) for k, _ in node.kv)
        assert node.ref >= 0
        assert sum(c.ref for c in node.children.values()) <= node.ref or node.ref >= 0
        for first, child in node.children.items():
            assert child.tokens[0] == first and child.parent is node


seqs = st.lists(st.integers(0, 3), min_size=1, max_size=10)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), seqs),
        st.tuples(st.just("match"), seqs),
        st.tuples(st.just("pin"), seqs),
        st.tuples(st.just("unpin"), st.integers(0, 5)),
        st.tuples(st.just("evict"), st.integers(0, 400)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, budget=st.integers(0, 600))
def test_tree_invariants_under_any_operation_sequence(ops, budget):
    tree = RadixCache(max_bytes=budget)
    pins = []  # (match, tokens matched)
    for op, arg in ops:
        if op == "insert":
            tree.insert(arg, kv_for_tokens(arg))
        elif op == "match":
            expect = max((len(p) for p in stored_paths(tree) if tuple(arg[: len(p)]) == p), default=0)
            m = tree.match(arg)
            assert m.length == expect  # the longest stored prefix
            seg = tree.gather(m)
            if m.length:
                got = [int(x) for x in seg[0][0].reshape(-1).tolist()]
                assert got == list(arg[: m.length])  # the KV really is this prefix's
                assert [int(-x / 2) for x in seg[1][1].reshape(-1).tolist()] == list(arg[: m.length])
        elif op == "pin":
            m = tree.match(arg)
            tree.pin(m.node)
            pins.append((m, tuple(arg[: m.length])))
        elif op == "unpin" and pins:
            m, _ = pins.pop(arg % len(pins))
            tree.unpin(m.node)
        elif op == "evict":
            tree.evict(arg)
        check_invariants(tree)
        # No pinned node is ever evicted: every pinned prefix is still fully stored.
        for m, toks in pins:
            if toks:
                assert tree.match(list(toks), record=False).length == len(toks)
                node = m.node
                while node.parent is not None:
                    assert node.kv is not None
                    node = node.parent
                assert node is tree.root
    for m, _ in pins:
        tree.unpin(m.node)
    tree.clear()
    assert tree.total_bytes == 0 and tree.num_nodes() == 0


def test_budget_is_respected_by_unpinned_entries():
    tree = RadixCache(max_bytes=10 * 8 * LAYERS)  # room for ~10 tokens (4 bytes x 2 arrays x layers)
    for i in range(20):
        s = [i, i + 1, i + 2]
        tree.insert(s, kv_for_tokens(s))
        assert tree.total_bytes <= tree.max_bytes
    assert tree.evictions > 0


def test_insert_reports_what_the_tree_already_held():
    tree = RadixCache(max_bytes=1 << 20)
    assert tree.insert([1, 2, 3, 4], kv_for_tokens([1, 2, 3, 4])).held == 0
    again = tree.insert([1, 2, 3, 4, 5, 6], kv_for_tokens([1, 2, 3, 4, 5, 6]))
    assert (again.held, again.length) == (4, 6)
    assert tree.insert([1, 2, 9], kv_for_tokens([1, 2, 9])).held == 2
    assert tree.insert([1, 2, 9], kv_for_tokens([1, 2, 9])).held == 3


# -- engine level ------------------------------------------------------------------------------------

def test_cache_hit_gives_same_tokens_as_cold_run(engine, tiny_model_dir):
    system = "You are a careful assistant. Answer briefly and precisely. " * 4
    prompts = [chat_ids(engine, q, system) for q in ("What is 7 plus 5?", "Name a red fruit.", "What is ice?")]
    cold_engine = Engine(engine.model_info.path, enable_prefix_cache=False)
    try:
        cold = [cold_engine.generate([p], max_tokens=20, temperature=0)[0] for p in prompts]
    finally:
        cold_engine.shutdown()
    first = engine.generate([prompts[0]], max_tokens=20, temperature=0)[0]
    warm = engine.generate(prompts, max_tokens=20, temperature=0)
    assert warm[1].usage.cached_tokens > 40 and warm[2].usage.cached_tokens > 40  # the shared system prompt
    assert first.token_ids == cold[0].token_ids
    for w, c in zip(warm, cold):
        assert w.token_ids == c.token_ids


def test_multi_turn_reuses_the_previous_conversation(engine):
    msgs = [{"role": "user", "content": "Name a big city in Japan."}]
    r1 = engine.chat(msgs, max_tokens=16, temperature=0)
    # The next turn as token ids: history + the answer as generated + a new user turn.
    turn = engine.encode("<|im_end|>\n<|im_start|>user\nAnd in Italy?<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)
    r2 = engine.generate([r1.prompt_token_ids + r1.token_ids + turn], max_tokens=8, temperature=0)[0]
    # Everything up to the end of the first answer was cached (prompt + generated tokens, except the
    # last generated token, whose KV was never computed).
    assert r2.usage.cached_tokens >= r1.usage.prompt_tokens + len(r1.token_ids) - 1
    # Re-rendered from text, the reuse goes as far as the text re-tokenises to the same ids, less a
    # last node of fewer than SHORT_TAIL_TOKENS tokens (recomputed; see paged_kv._without_short_tail).
    from parallm_engine.kv.paged_kv import SHORT_TAIL_TOKENS

    msgs2 = msgs + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And in Italy?"}]
    r3 = engine.generate([engine.apply_chat_template(msgs2)], max_tokens=8, temperature=0)[0]
    assert r3.usage.cached_tokens >= r1.usage.prompt_tokens - SHORT_TAIL_TOKENS


def test_no_kv_leaks_after_splits_and_evictions(tiny_model_dir):
    """A tiny prefix budget forces evictions and partial-match splits all the time; every output must
    still equal the output of an engine without any cache."""
    import random

    rng = random.Random(0)
    base = [rng.randrange(100, 5000) for _ in range(40)]
    prompts = []
    for i in range(12):
        cut = rng.randrange(5, 40)
        prompts.append(base[:cut] + [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 10))])
    plain = Engine(str(tiny_model_dir), enable_prefix_cache=False)
    small = Engine(str(tiny_model_dir), prefix_cache_bytes=30 * 2 * 2 * 2 * 16 * 4)  # ~30 tokens of KV
    try:
        expect = [plain.generate([p], max_tokens=6, temperature=0)[0].token_ids for p in prompts]
        for round_ in range(2):
            order = list(range(len(prompts)))
            rng.shuffle(order)
            got = small.generate([prompts[i] for i in order], max_tokens=6, temperature=0)
            for i, r in zip(order, got):
                assert r.token_ids == expect[i], f"request {i} differs in round {round_}"
            for i in order[:4]:  # and one at a time, interleaved with evictions
                assert small.generate([prompts[i]], max_tokens=6, temperature=0)[0].token_ids == expect[i]
        radix = small._scheduler.radix
        # Read on the engine thread, between steps (the tree is only ever touched there).
        st_, recount = small.run_on_engine_thread(lambda: (radix.stats(), radix.computed_bytes()))
        assert st_["evictions"] > 0 and st_["bytes"] <= st_["max_bytes"]
        assert recount == st_["bytes"]
    finally:
        plain.shutdown()
        small.shutdown()


def test_fanout_prefills_shared_prefix_once(engine):
    """32 requests at once with a shared 512-token prefix and distinct 32-token suffixes compute
    <= 1.1 x (512 + 32 x 32) prefill tokens (in-flight dedup: the first prefills, the rest hit)."""
    import random

    rng = random.Random(1)
    prefix = [rng.randrange(1000, 40000) for _ in range(512)]
    prompts = [prefix + [rng.randrange(1000, 40000) for _ in range(32)] for _ in range(32)]
    before = engine.stats()["prefill_tokens"]
    results = engine.generate(prompts, max_tokens=2, temperature=0)
    computed = engine.stats()["prefill_tokens"] - before
    assert computed <= 1.1 * (512 + 32 * 32), computed
    assert sum(r.usage.cached_tokens >= 512 for r in results) >= 31


def test_n_choices_prefill_prompt_once(engine):
    import random

    rng = random.Random(2)
    prompt = [rng.randrange(1000, 40000) for _ in range(300)]
    before = engine.stats()["prefill_tokens"]
    r = engine.generate([prompt], max_tokens=4, temperature=1.0, n=4, seed=9)[0]
    assert len(r.choices) == 4
    assert engine.stats()["prefill_tokens"] - before <= 300 + 4  # forks after the prompt
