"""A LangGraph graph whose nodes use different LoRA adapters, fanned out as one batch on one base model.

    ticket --Send--> [router, sql, summary, base] x tickets --> collect

Agent systems give roles their own fine-tunes over one base model: a router, a SQL writer, a summariser.
Here each role is a LoRA adapter (mlx-lm's format; the script writes random ones with mlx-lm's own LoRA
layers so it runs anywhere: pass ``--adapter NAME=DIR`` for real ones trained with ``mlx_lm.lora``). One
``ChatParaLLM`` serves them all: each node binds its adapter (``llm.bind(adapter=...)``), ``Send`` fans
the tickets out to every role at once, and the engine decodes every branch in the same batch (rows with
different adapters share one forward; ``docs/lora.md``). The script prints the engine's peak number of
rows decoding together and the adapters resident.

    .venv/bin/python cookbook/langgraph_lora_roles.py
    .venv/bin/python cookbook/langgraph_lora_roles.py --adapter sql=./my_sql_adapter --adapter router=./router
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import tempfile
import time
from pathlib import Path
from typing import Annotated

from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from typing_extensions import TypedDict

from parallm_integrations import ChatParaLLM

ROLES = {
    "router": "Which team should handle this ticket: billing, shipping or tech? Answer with one word.",
    "sql": "Write one SQL query over orders(id, customer, status, placed_at) that finds the orders this ticket is about.",
    "summary": "Summarise this ticket in one sentence.",
}
TICKETS = [
    "My order #1042 was charged twice and still shows as pending.",
    "The parcel for order #2210 has been stuck in Lyon since Monday.",
    "I cannot log in to the app after the last update; it crashes on start.",
    "Order #3307 arrived with a broken lid, I want a refund.",
]


class State(TypedDict):
    tickets: list[str]
    answers: Annotated[list[tuple[str, str, str]], operator.add]


class Branch(TypedDict):
    ticket: str
    role: str


def build_graph(llm: ChatParaLLM, roles: list[str]):
    async def run_role(branch: Branch) -> dict:
        role = branch["role"]
        system = ROLES.get(role, "Answer the ticket helpfully in one sentence.")
        adapter = None if role == "base" else role
        msg = await llm.bind(adapter=adapter).ainvoke([("system", system), ("user", branch["ticket"])])
        return {"answers": [(role, branch["ticket"], msg.content.strip())]}

    def fan_out(state: State) -> list[Send]:
        return [Send("role", {"ticket": t, "role": r}) for t in state["tickets"] for r in roles]

    graph = StateGraph(State)
    graph.add_node("role", run_role)
    graph.add_conditional_edges(START, fan_out, ["role"])
    graph.add_edge("role", END)
    return graph.compile()


def _adapter_arg(text: str) -> tuple[str, str]:
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, path


def random_adapters(out: Path) -> dict[str, str]:
    """One random adapter per role for the default model (mlx-lm's own LoRA layers, non-zero B)."""
    from parallm_bench.lora import write_random_adapter
    from parallm_engine.models.loader import resolve_model

    base_dir, _ = resolve_model(None)
    return {role: str(write_random_adapter(base_dir, out / role, rank=8, seed=i, b_std=0.002))
            for i, role in enumerate(ROLES)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", type=_adapter_arg, action="append", default=None, metavar="NAME=DIR")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parallm-lora-roles-") as tmp:
        adapters = dict(args.adapter) if args.adapter else random_adapters(Path(tmp))
        llm = ChatParaLLM(engine_kwargs={"adapters": adapters}, temperature=0, max_tokens=args.max_tokens)
        engine = llm._get_engine()
        engine.reset_peaks()
        roles = [*adapters, "base"]
        t0 = time.perf_counter()
        out = await build_graph(llm, roles).ainvoke({"tickets": TICKETS, "answers": []})
        wall = time.perf_counter() - t0
        for role, ticket, answer in sorted(out["answers"]):
            print(f"[{role:>8}] {ticket[:48]:<48} -> {answer[:90]!r}")
        stats = engine.stats()
        print(f"\n{len(out['answers'])} branches ({len(TICKETS)} tickets x {len(roles)} roles) in {wall:.1f} s; "
              f"peak rows decoding together: {stats['peak_running']}; adapters resident: "
              f"{stats['adapters']['resident']} ({stats['adapters']['stack_bytes'] / 2**20:.1f} MiB stacked)")


if __name__ == "__main__":
    asyncio.run(main())
