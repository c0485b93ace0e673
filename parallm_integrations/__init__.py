"""LangChain and LlamaIndex classes on the shared ParaLLM engine.

The in-process engine is the ``engine`` extra (``pip install "parallm-integrations[engine]"``); without
it the classes work with ``base_url=`` (a ParaLLM or OpenAI-compatible server). Importing this package
imports neither the engine nor MLX.
"""

from parallm_integrations.chat_models import ChatParaLLM
from parallm_integrations.embeddings import ParaLLMEmbeddings
from parallm_integrations.llms import ParaLLM

__all__ = ["ChatParaLLM", "ParaLLM", "ParaLLMEmbeddings", "ParaLLMRerank"]

#: Classes of optional integrations, imported on first use: ``dspy`` is not a dependency (so they stay out
#: of ``__all__``: ``import *`` must work without it).
_LAZY = {"ParaLLMDSPy": "parallm_integrations.dspy", "ParaLLMAdapter": "parallm_integrations.dspy",
         "ParaLLMRerank": "parallm_integrations.rerank"}  # this one's dependency is langchain-core's: in __all__


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
