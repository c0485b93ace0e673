"""LangChain and LlamaIndex classes on the shared ParaLLM engine.

The in-process engine is the ``engine`` extra (``pip install "parallm-integrations[engine]"``); without
it the classes work with ``base_url=`` (a ParaLLM or OpenAI-compatible server). Importing this package
imports neither the engine nor MLX.
"""

from parallm_integrations.chat_models import ChatParaLLM
from parallm_integrations.embeddings import ParaLLMEmbeddings
from parallm_integrations.llms import ParaLLM

__all__ = ["ChatParaLLM", "ParaLLM", "ParaLLMEmbeddings"]
