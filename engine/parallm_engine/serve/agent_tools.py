"""The tools coding agents send that are not plain functions, as the model is offered them.

- OpenAI Responses ``namespace`` tools (Codex CLI's ``multi_agent_v1``) group function tools: each is offered
  to the model as ``<namespace>__<name>`` (function names allow only ``[A-Za-z0-9_-]``), and a call of that
  name is reported as ``{"name": <name>, "namespace": <namespace>}``, as OpenAI reports it; a
  ``function_call`` item sent back with its ``namespace`` is shown to the model under the offered name again.
- Hosted tools, which OpenAI's or Anthropic's servers run (``web_search``, ``file_search``,
  ``code_interpreter``, Anthropic's ``web_search_20250305``...), and the Responses API's built-in client tools
  whose calls have item types of their own (``local_shell``, ``shell``, ``apply_patch``...) cannot run here:
  they are not offered to the model (the request is answered, not refused), and the response names them in
  the :data:`IGNORED_TOOLS_HEADER` header (their types, comma-separated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallm_engine.serve.openai_format import APIError

#: The response header naming the tools of a request that were not offered to the model.
IGNORED_TOOLS_HEADER = "x-parallm-ignored-tools"
NAMESPACE_SEPARATOR = "__"
MAX_TOOL_NAME = 64


@dataclass
class OfferedTools:
    """The function tools the model is offered (chat-completions shape), and how calls map back."""

    tools: list[dict] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)  # offered name -> (namespace, name)
    ignored: list[str] = field(default_factory=list)  # the types not offered, in order, once each

    def ignore(self, kind: str) -> None:
        if kind not in self.ignored:
            self.ignored.append(kind)

    def headers(self) -> dict[str, str]:
        return {IGNORED_TOOLS_HEADER: ",".join(self.ignored)} if self.ignored else {}

    def reported(self, offered: str) -> tuple[str, str | None]:
        """A call's (name, namespace) as the client named the tool."""
        namespace, name = self.namespaces.get(offered, (None, offered))
        return name, namespace


def offered_name(name: str, namespace: str | None) -> str:
    """The name a namespaced function is offered to the model under."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def function_tool(name: str, description: str | None, parameters: dict | None, strict: bool | None = None) -> dict:
    fn = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def responses_tools(tools: list | None) -> OfferedTools:
    """A Responses request's ``tools`` (validated items with ``type``, ``name``, ``description``,
    ``parameters``, ``strict`` and, for a namespace, ``tools``) as the model is offered them."""
    out = OfferedTools()
    seen: set[str] = set()

    def add(t, namespace: str | None, param: str) -> None:
        if not t.name:
            raise APIError(400, f"{param}: a function tool needs a name", param=f"{param}.name")
        name = offered_name(t.name, namespace)
        if len(name) > MAX_TOOL_NAME:
            raise APIError(400, f"{param}: the namespaced name {name!r} is longer than {MAX_TOOL_NAME} characters",
                           param=f"{param}.name")
        if name in seen:
            raise APIError(400, f"{param}: a second tool named {name!r}", param=f"{param}.name")
        seen.add(name)
        if namespace:
            out.namespaces[name] = (namespace, t.name)
        out.tools.append(function_tool(name, t.description, t.parameters, t.strict))

    for i, t in enumerate(tools or []):
        param = f"tools[{i}]"
        if t.type == "function":
            add(t, None, param)
        elif t.type == "namespace":
            if not t.name:
                raise APIError(400, f"{param}: a namespace needs a name", param=f"{param}.name")
            for j, inner in enumerate(t.tools or []):
                if inner.type != "function":
                    raise APIError(400, f"{param}.tools[{j}]: only function tools are supported in a namespace, "
                                   f"not {inner.type!r}", param=f"{param}.tools[{j}].type")
                add(inner, t.name, f"{param}.tools[{j}]")
        elif t.type == "custom":
            raise APIError(400, f"{param}: custom (free-form text) tools are not supported; give function tools",
                           param=f"{param}.type")
        else:  # hosted, or a built-in client tool with item types of its own: not offered
            out.ignore(t.type)
    return out


def anthropic_tools(tools: list | None) -> OfferedTools:
    """A Messages request's ``tools``: custom tools (``type`` absent or ``custom``) are offered; Anthropic's
    server and versioned built-in tools (``web_search_20250305``, ``bash_20250124``...) are not."""
    out = OfferedTools()
    for t in tools or []:
        if t.type in (None, "custom"):
            out.tools.append(function_tool(t.name, t.description, t.input_schema))
        else:
            out.ignore(t.type)
    return out
