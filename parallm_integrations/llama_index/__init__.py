"""LlamaIndex LLM on the shared ParaLLM engine.

::

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    llm = ParaLLMLlamaIndex(temperature=0, max_tokens=128)   # loads nothing yet
    llm.complete("Name three primary colours.")

Every ``ParaLLMLlamaIndex`` (and every LangChain ``ChatParaLLM`` / ``ParaLLM``) naming the same model
in one process shares one engine: one copy of the weights, one continuous batch, one prefix cache.
"""

from parallm_integrations.llama_index.base import ParaLLMLlamaIndex

__all__ = ["ParaLLMLlamaIndex"]
