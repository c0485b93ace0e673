"""LlamaIndex LLM on the shared ParaLLM engine.

::

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    llm = ParaLLMLlamaIndex(temperature=0, max_tokens=128)   # loads nothing yet
    llm.complete("Name three primary colours.")

Every ``ParaLLMLlamaIndex`` (and every LangChain ``ChatParaLLM`` / ``ParaLLM``) naming the same model
in one process shares one engine: one copy of the weights, one continuous batch, one prefix cache.

``ParaLLMLlamaIndex(base_url="http://localhost:8000/v1", api_key=...)`` (or ``PARALLM_BASE_URL`` /
``PARALLM_API_KEY``) sends the same requests to an OpenAI-compatible server instead (``parallm serve``,
vLLM, SGLang, mlx-lm's server), with the same responses.
"""

from parallm_integrations.llama_index.base import ParaLLMLlamaIndex
from parallm_integrations.llama_index.embedding import ParaLLMEmbedding
from parallm_integrations.llama_index.rerank import ParaLLMRerank

__all__ = ["ParaLLMLlamaIndex", "ParaLLMEmbedding", "ParaLLMRerank"]
