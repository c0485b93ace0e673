"""The engine core's layout (issue 33): the scheduler only plans. Its modules (``scheduler.py`` and the
prefill planning it takes in, ``prefill_planner.py``) run no forward, name no KV class and use no MLX
op; the model runner runs the forwards, the KV cache manager owns the KV."""

import re
from pathlib import Path

import parallm_engine

PACKAGE = Path(parallm_engine.__file__).parent / "core"
PLANNING = ["scheduler.py", "prefill_planner.py"]
FORBIDDEN = re.compile(r"model\(|RadixCache|PagedLaneKV|SequenceKV|FrozenKV|PrefillBatchKV|mx\.")


def test_the_scheduler_only_plans():
    for name in PLANNING:
        source = (PACKAGE / name).read_text()
        hits = [line for line in source.splitlines() if FORBIDDEN.search(line)]
        assert not hits, (name, hits)
        assert not re.search(r"^\s*(import mlx|from mlx)", source, re.M), name


def test_the_scheduler_is_small():
    assert len((PACKAGE / "scheduler.py").read_text().splitlines()) < 350


def test_a_family_quirk_lives_in_its_adapter():
    """gemma2's 5-D scores: only its adapter knows (no cache, batch or kernel threads a mask flag), and it
    switches the engine's model instance only: another model of the same class keeps mlx-lm's class."""
    import mlx.core as mx
    from mlx_lm.models import gemma2

    from parallm_engine.runner.family_adapters import Gemma2Adapter, adapter_for

    root = PACKAGE.parent
    hits = [str(p.relative_to(root)) for p in root.rglob("*.py")
            if "mask_5d" in p.read_text() or ("gemma2" in p.read_text() and p.name != "family_adapters.py")]
    assert not hits, hits

    args = gemma2.ModelArgs(model_type="gemma2", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                            num_attention_heads=4, head_dim=8, rms_norm_eps=1e-6, vocab_size=64,
                            num_key_value_heads=2)
    engine_model, user_model = gemma2.Model(args), gemma2.Model(args)
    user_model.update(engine_model.parameters())
    adapter = adapter_for(type("Info", (), {"config": {"model_type": "gemma2"}})())
    assert isinstance(adapter, Gemma2Adapter)
    adapter.install(engine_model)
    attn = engine_model.layers[0].self_attn
    assert type(attn) is not gemma2.Attention and isinstance(attn, gemma2.Attention)
    assert type(user_model.layers[0].self_attn) is gemma2.Attention
    # A (B, 1, L, S) mask as the engine's caches make it == mlx-lm's own 5-D layout on the user's model.
    x = mx.random.normal((2, 3, 32))
    mask = mx.array([[True, False, False], [True, True, False], [True, True, True]])
    mask = mx.broadcast_to(mask, (2, 1, 3, 3))
    ours = attn(x, mask)
    theirs = user_model.layers[0].self_attn(x, mask[:, :, None])
    assert mx.array_equal(ours, theirs).item()


def test_the_runner_reports_a_step_instead_of_writing_the_plan():
    """``ModelRunner.execute(plan) -> StepOutput``: no module assigns to a plan's or a work item's fields
    (both are frozen; what ran comes back in ``StepOutput``)."""
    import ast
    import dataclasses

    from parallm_engine.runner.step_plan import PrefillWork, StepOutput, StepPlan

    root = PACKAGE.parent
    writes = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "plan":
                    writes.append(f"{path.relative_to(root)}:{node.lineno} {t.value.id}.{t.attr}")
    assert not writes, writes
    assert StepPlan.__dataclass_params__.frozen and PrefillWork.__dataclass_params__.frozen
    measured = {f.name for f in dataclasses.fields(StepOutput)}
    assert measured.isdisjoint(f.name for f in dataclasses.fields(StepPlan))


def test_a_plan_is_complete_and_frozen_before_it_runs(tiny_model_dir):
    """On a real workload (a burst, then prompts arriving into a running batch, one of them longer than a
    chunk): every plan the scheduler returns holds only tuples (its prefill items planned in full, none
    drawn lazily), the runner leaves it exactly as it got it, and its message (sequences by key) is small,
    JSON-serialisable and complete: every step runs the plan rebuilt from it."""
    import dataclasses
    import json

    from parallm_engine import Engine
    from parallm_engine.runner.step_plan import StepPlan, seq_key

    from .model_zoo import prompt_ids

    eng = Engine(str(tiny_model_dir), decode_lanes=1, prefill_chunk=64)
    seen = []
    try:
        runner = eng._scheduler.runner
        execute = runner.execute

        def checked(plan):
            def snapshot():
                return [(f.name, getattr(plan, f.name)) for f in dataclasses.fields(plan)], \
                    [(w.kind, w.seqs, w.new, w.fused, w.finishes) for w in plan.prefill]

            for f in dataclasses.fields(plan):
                value = getattr(plan, f.name)
                assert not isinstance(value, (list, dict, set)) and not hasattr(value, "__next__"), f.name
            before = snapshot()
            with __import__("pytest").raises(dataclasses.FrozenInstanceError):
                plan.prefill = ()
            # The plan's message (what another rank would receive) is small JSON and gives the same plan
            # back; the step runs the plan rebuilt from it.
            wire = json.dumps(plan.message())
            named = sum(len(w.seqs) + len(w.finishes) for w in plan.prefill) + len(plan.admitted) + len(plan.preempted)
            assert len(wire) <= 200 + 80 * named, wire
            sequences = {tuple(seq_key(s)): s for r in eng._scheduler.out.requests.values() for s in r.sequences}
            rebuilt = StepPlan.from_message(json.loads(wire), sequences)
            assert rebuilt == plan
            out = execute(rebuilt)
            assert snapshot() == before
            assert out.prefill_ran <= len(plan.prefill)
            seen.append(len(plan.prefill))
            return out

        runner.execute = checked
        vocab = eng.model_info.vocab_size
        eng.generate([prompt_ids(20 + i, vocab, seed=i) for i in range(6)], max_tokens=4, temperature=0)
        streams = eng.submit(prompt_ids(10, vocab, seed=50), max_tokens=30, temperature=0, ignore_eos=True)
        eng.generate([prompt_ids(150, vocab, seed=51), prompt_ids(12, vocab, seed=52)], max_tokens=4, temperature=0)
        eng._collect(streams)
    finally:
        eng.shutdown()
    assert max(seen) >= 2  # steps planned several items at once


#: Modules that call a model of their own, not the engine's rows: load-time probes, the draft model, the
#: BERT-family encoder engine and its cross-encoder (reranker) subclass.
OWN_MODELS = {"runner/logits_head.py", "kv/kv_quant.py", "spec/draft_model.py", "embed/encoder_engine.py",
              "embed/cross_encoder.py"}


def test_the_model_is_called_from_one_module():
    """Every forward of engine rows goes through ``runner/forward.py`` (prefill, decode, ragged, fused, the
    compiled step): vision, embeddings and LoRA supply their parts to it instead of wrapping the model."""
    import ast

    root = PACKAGE.parent
    calls = []
    for path in root.rglob("*.py"):
        name = str(path.relative_to(root))
        if name == "runner/forward.py" or name in OWN_MODELS:
            continue
        tree = ast.parse(path.read_text())
        own = {id(n) for d in ast.walk(tree) if isinstance(d, ast.FunctionDef) and d.name == "__call__"
               for n in ast.walk(d)}  # a model class's own forward (the VLM wrapper's) calls its parts
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or id(node) in own:
                continue
            f = node.func
            if (isinstance(f, ast.Name) and f.id in ("model", "backbone", "head")) or \
                    (isinstance(f, ast.Attribute) and f.attr in ("model", "language_model")):
                calls.append(f"{name}:{node.lineno}")
    assert not calls, calls


def test_no_layout_branch_outside_kv():
    """The KV layout ("attention": paged; "mixed": mlx-lm's caches) is kv's: other layers ask it what it can
    do (``prefills_alone``, ``takes_ragged_steps``, ``rolls_back``, ``prefill_lanes``) instead of comparing
    layout names."""
    import ast

    root = PACKAGE.parent
    branches = []
    for path in root.rglob("*.py"):
        if path.parent.name == "kv":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            parts = [node.left, *node.comparators]
            names = any(isinstance(p, ast.Constant) and p.value in ("attention", "mixed") for p in parts)
            layout = any(isinstance(p, (ast.Attribute, ast.Name)) and getattr(p, "attr", getattr(p, "id", None))
                         == "layout" for p in parts)
            if names or layout:
                branches.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not branches, branches


def test_no_write_to_another_objects_private_attribute():
    """A module sets private attributes (``_x``) on ``self`` or ``cls`` only: another object's, an other
    package's included, are reached through what that object offers."""
    import ast

    import parallm_integrations

    roots = [PACKAGE.parent, Path(parallm_integrations.__file__).parent]
    writes = []
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                for t in flat:
                    if isinstance(t, ast.Attribute) and t.attr.startswith("_") and not t.attr.startswith("__") \
                            and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                        writes.append(f"{path.relative_to(root.parent)}:{node.lineno} .{t.attr}")
    assert not writes, writes


def test_other_layers_reach_the_engine_thread_through_its_commands():
    """The engine thread is one object, ``Engine.core`` (``core/engine_core.py``): its queue, counters and
    scheduler are its own; other layers call ``take_queue_slot`` / ``enqueue_add`` / ``enqueue_abort`` /
    ``reject_queued`` / ``call`` on it instead of reaching into an engine, and ``Engine`` takes no mixin for
    the thread."""
    import ast

    from parallm_engine.core.engine import Engine
    from parallm_engine.core.engine_core import EngineCore

    assert not any(issubclass(base, EngineCore) for base in Engine.__mro__)
    private = {"_commands", "_pending", "_aborting", "_wake", "_lock", "_scheduler", "_stop", "_thread"}
    root = PACKAGE.parent
    reach = []
    for path in root.rglob("*.py"):
        if path.name == "engine_core.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private and isinstance(node.value, (ast.Name, ast.Attribute)) \
                    and getattr(node.value, "id", getattr(node.value, "attr", None)) in ("engine", "eng", "core"):
                reach.append(f"{path.relative_to(root)}:{node.lineno} .{node.attr}")
    assert not reach, reach
