"""LangChain and LlamaIndex classes on the shared ParaLLM engine."""

from parallm_integrations.chat_models import ChatParaLLM
from parallm_integrations.llms import ParaLLM

__all__ = ["ChatParaLLM", "ParaLLM"]
