"""Sampling defaults from the model (generation_config.json, GGUF ``general.sampling.*``, the known-model table)
for every field a caller leaves unset, in the engine, the server, ``parallm info`` and the integrations; and
invalid sampling settings failing when ChatParaLLM / ParaLLM / ParaLLMLlamaIndex are constructed."""

from __future__ import annotations

import json
import logging
import shutil
import struct

import pytest
from openai import OpenAI
from pydantic import ValidationError

from parallm_engine import InvalidRequestError, SamplingParams
from parallm_engine.models.gguf import gguf_sampling_defaults, read_gguf_metadata
from parallm_engine.models.loader import RECOMMENDED_SAMPLING, peek_sampling_defaults, sampling_defaults
from parallm_engine.sampling.sampling_params import MODEL_DEFAULT_FIELDS, apply_model_defaults
from parallm_integrations import ChatParaLLM, ParaLLM
from parallm_integrations.llama_index import ParaLLMLlamaIndex

from .conftest import chat_ids

#: What the embedded model samples with when a request sets nothing: its model card's temperature / top_p,
#: Ollama's repeat penalty and a 512-token cap (loader.RECOMMENDED_SAMPLING).
SMOL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 512}
GEN_03 = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.3, "top_k": 40}


@pytest.fixture(scope="module")
def model_dir_03(tiny_model_dir, tmp_path_factory):
    """The tiny random model, with a generation_config.json that recommends temperature 0.3 and top_k 40."""
    out = tmp_path_factory.mktemp("tiny-t03")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    (out / "generation_config.json").write_text(json.dumps(GEN_03))
    return out


@pytest.fixture(scope="module")
def engine_03(model_dir_03):
    from parallm_engine import get_engine

    return get_engine(str(model_dir_03))


def _run(engine, prompt, **sampling):
    handle = engine.submit(prompt, max_tokens=3, **sampling)
    for _ in handle:
        pass
    assert handle.request.result.usage.completion_tokens >= 1
    return handle.request.params  # the settings the request was sampled with


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------


def test_generation_config_temperature_is_used_when_unset_and_explicit_values_win(engine_03):
    info = engine_03.model_info
    assert engine_03.sampling_defaults == {"temperature": 0.3, "top_k": 40}
    assert info.sampling_defaults_source.endswith("generation_config.json")
    prompt = chat_ids(engine_03, "Hello")
    used = _run(engine_03, prompt)
    assert (used.temperature, used.top_k, used.top_p) == (0.3, 40, 1.0)
    used = _run(engine_03, prompt, temperature=None, top_k=None)  # None = unset, as OpenAI clients send it
    assert (used.temperature, used.top_k) == (0.3, 40)
    used = _run(engine_03, prompt, temperature=1.0)
    assert (used.temperature, used.top_k) == (1.0, 40)  # explicit wins, per field
    used = _run(engine_03, prompt, temperature=0, top_k=0, seed=1)
    assert (used.temperature, used.top_k) == (0.0, 0)


def test_explicit_params_object_is_used_as_given(engine_03):
    used = _run(engine_03, chat_ids(engine_03, "Hi"), params=SamplingParams(max_tokens=2))
    assert used.temperature == 1.0 and used.top_k == 0


def test_model_without_recommendation_keeps_engine_defaults(tiny_engine):
    assert tiny_engine.sampling_defaults == {}
    assert tiny_engine.model_info.sampling_defaults_source == "engine defaults"
    used = _run(tiny_engine, chat_ids(tiny_engine, "Hello"))
    assert (used.temperature, used.top_p) == (1.0, 1.0)


def test_default_model_samples_as_its_model_card_recommends(engine):
    assert engine.sampling_defaults == SMOL_DEFAULTS
    assert "SmolLM2-135M-Instruct model card" in engine.model_info.sampling_defaults_source
    used = _run(engine, chat_ids(engine, "What is the capital of France?"))  # max_tokens=3 given: it wins
    assert (used.temperature, used.top_p, used.repetition_penalty, used.max_tokens) == (0.2, 0.9, 1.1, 3)
    handle = engine.submit(chat_ids(engine, "Hi"), max_tokens=None, temperature=0)
    assert handle.request.params.max_tokens == 512 and handle.request.cycle_guard
    # greedy stays plain greedy (what mlx-lm decodes): the penalty is for sampled requests
    assert handle.request.params.repetition_penalty == 1.0
    handle.abort()


def test_apply_model_defaults_only_fills_unset_recommendable_fields():
    out = apply_model_defaults({"temperature": None, "top_p": 0.5, "max_tokens": 4},
                               {"temperature": 0.3, "top_p": 0.9, "max_tokens": 99})
    assert out == {"temperature": 0.3, "top_p": 0.5, "max_tokens": 4}
    penalty = {"temperature": 0.2, "repetition_penalty": 1.1}
    assert apply_model_defaults({"temperature": 0}, penalty) == {"temperature": 0}
    assert apply_model_defaults({"temperature": 0.5}, penalty) == {"temperature": 0.5, "repetition_penalty": 1.1}
    assert apply_model_defaults({}, penalty) == penalty
    assert set(MODEL_DEFAULT_FIELDS) == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"}


# ----------------------------------------------------------------------------------------------
# Where the recommendation is read from
# ----------------------------------------------------------------------------------------------


def _write_gguf(path, kv: dict) -> None:
    """A header-only GGUF v3 file (no tensors) with the given metadata: (type id, value) per key."""
    def s(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    fmt = {4: "I", 5: "i", 6: "f"}
    for key, (vtype, value) in kv.items():
        body += s(key) + struct.pack("<I", vtype)
        if vtype == 8:
            body += s(value)
        elif vtype == 9:  # array of strings
            body += struct.pack("<IQ", 8, len(value)) + b"".join(s(v) for v in value)
        else:
            body += struct.pack("<" + fmt[vtype], value)
    path.write_bytes(body)


def test_gguf_sampling_metadata_is_read(tmp_path):
    gguf = tmp_path / "model.gguf"
    _write_gguf(gguf, {
        "general.architecture": (8, "llama"),
        "tokenizer.ggml.tokens": (9, ["a", "bb", "<|im_end|>"]),  # arrays are skipped, not parsed into values
        "general.sampling.temp": (6, 0.6),
        "general.sampling.top_k": (5, 20),
        "general.sampling.top_p": (6, 0.95),
        "general.sampling.min_p": (6, 0.0),
        "llama.block_count": (4, 2),
    })
    meta = read_gguf_metadata(gguf)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    assert "tokenizer.ggml.tokens" not in meta
    assert gguf_sampling_defaults(gguf) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
    values, source = sampling_defaults(tmp_path / "converted-not-yet", ["model"], gguf)
    assert values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    assert "general.sampling" in source
    assert peek_sampling_defaults(str(gguf))[0] == values


def test_generation_config_wins_over_gguf_and_table(tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct.gguf"
    _write_gguf(gguf, {"general.sampling.temp": (6, 0.6)})
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "repetition_penalty": 1.1}))
    assert sampling_defaults(tmp_path, [gguf.stem], gguf)[0] == {"temperature": 0.7, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert sampling_defaults(tmp_path, [gguf.stem], gguf)[0] == {"temperature": 0.6}
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # says nothing: the table (matched by name)
    assert sampling_defaults(tmp_path, [gguf.stem], gguf)[0] == RECOMMENDED_SAMPLING["SmolLM2-135M-Instruct"]


def test_known_model_table_matches_names_and_paths(tmp_path):
    card = SMOL_DEFAULTS
    for name in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct-8bit",
                 "SmolLM2-135M-Instruct.Q4_1"):
        assert sampling_defaults(tmp_path, [name])[0] == card, name
    assert sampling_defaults(tmp_path, ["SmolLM2-135M"]) == ({}, "engine defaults")  # the base model: no card
    assert peek_sampling_defaults(None)[0] == card
    assert peek_sampling_defaults(str(tmp_path / "missing")) == ({}, "unknown")


def test_invalid_recommendations_are_ignored_with_a_warning(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 0.8, "top_k": "x"}))
    with caplog.at_level(logging.WARNING, logger="parallm_engine"):
        assert sampling_defaults(tmp_path, ["m"])[0] == {"top_p": 0.8}
    assert "temperature=-1" in caplog.text and "top_k='x'" in caplog.text


# ----------------------------------------------------------------------------------------------
# The server, parallm info
# ----------------------------------------------------------------------------------------------


def test_server_applies_the_model_defaults_when_a_request_omits_them(engine_03, monkeypatch):
    from parallm_engine.serve.server import ServerThread

    submitted = []
    real_submit = engine_03.submit

    def recording_submit(*args, **kwargs):  # the real submit; keep the handle to read its settings
        submitted.append(real_submit(*args, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(engine_03, "submit", recording_submit)
    with ServerThread(engine=engine_03) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
        client.chat.completions.create(model=engine_03.model_name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2)
        client.completions.create(model=engine_03.model_name, prompt="Once upon", max_tokens=2, temperature=1.0)
    chat, completion = (h.request.params for h in submitted)
    assert (chat.temperature, chat.top_k) == (0.3, 40)
    assert (completion.temperature, completion.top_k) == (1.0, 40)


def test_parallm_info_shows_the_sampling_in_use(capsys, model_dir_03):
    from parallm_engine.cli import main

    assert main(["info", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sampling_defaults"]["values"] == SMOL_DEFAULTS
    assert main(["info", "--model", str(model_dir_03), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sampling_defaults"]["values"] == {"temperature": 0.3, "top_k": 40}
    assert main(["info"]) == 0
    shown = capsys.readouterr().out
    assert "sampling: temperature 0.2, top_p 0.9, repetition_penalty 1.1, max_tokens 512 for requests that set none" \
        in shown and "temperature 0 stays plain greedy" in shown
    assert "guard   : a request that sets no max_tokens stops when it repeats" in shown


# ----------------------------------------------------------------------------------------------
# The integrations: what is used, and errors at construction
# ----------------------------------------------------------------------------------------------


def test_identifying_and_langsmith_params_show_the_sampling_in_use(model_dir_03):
    llm = ChatParaLLM()
    assert {k: llm._identifying_params[k] for k in SMOL_DEFAULTS} == SMOL_DEFAULTS
    assert ChatParaLLM(max_tokens=64, repetition_penalty=1.0)._identifying_params["max_tokens"] == 64
    assert "repetition_penalty" not in ChatParaLLM(temperature=0)._identifying_params
    assert llm._get_ls_params()["ls_temperature"] == 0.2
    assert llm._engine is None  # read from the model's files: nothing loaded
    explicit = ChatParaLLM(temperature=1.0)
    assert explicit._identifying_params["temperature"] == 1.0 and explicit._identifying_params["top_p"] == 0.9
    assert explicit._get_ls_params()["ls_temperature"] == 1.0
    assert ChatParaLLM()._get_ls_params(temperature=0.5)["ls_temperature"] == 0.5
    tiny = ParaLLM(model=str(model_dir_03))
    assert tiny._identifying_params["temperature"] == 0.3 and tiny._identifying_params["top_k"] == 40
    remote = ChatParaLLM(base_url="http://127.0.0.1:9/v1")  # the server decides
    assert "temperature" not in remote._identifying_params and "ls_temperature" not in remote._get_ls_params()


def test_identifying_params_follow_the_loaded_engine(engine_03, model_dir_03):
    llm = ChatParaLLM(model=str(model_dir_03), max_tokens=2)
    llm.invoke("Hi")
    assert llm._engine is engine_03
    assert llm._identifying_params["temperature"] == 0.3


# (field, invalid value) for every sampling setting the classes take.
INVALID = [
    ("temperature", -1.0), ("temperature", float("inf")), ("max_tokens", 0), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5), ("seed", -1), ("stop", [""]),
]
INVALID_LANGCHAIN_ONLY = [
    ("n", 0), ("n", 500), ("top_logprobs", 21), ("logit_bias", {5: 101.0}), ("stop_token_ids", [-1]),
]


def _engine_message(name, value) -> str:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_kwargs(**{name: value})
    return str(info.value)


@pytest.mark.parametrize("cls", [ChatParaLLM, ParaLLM, ParaLLMLlamaIndex], ids=lambda c: c.__name__)
@pytest.mark.parametrize(("name", "value"), INVALID + INVALID_LANGCHAIN_ONLY)
def test_invalid_sampling_fails_at_construction_with_the_engine_message(cls, name, value):
    message = _engine_message(name, value)
    if cls is ParaLLMLlamaIndex and (name, value) in INVALID_LANGCHAIN_ONLY:
        with pytest.raises(ValidationError, match=re_escape(message)):  # these go in additional_kwargs
            cls(additional_kwargs={name: value})
        return
    with pytest.raises(ValidationError, match=re_escape(message)):
        cls(**{name: value})


@pytest.mark.parametrize("cls", [ChatParaLLM, ParaLLM], ids=lambda c: c.__name__)
def test_invalid_sampling_in_model_kwargs_fails_at_construction(cls):
    with pytest.raises(ValidationError, match="temperature must be >= 0.0"):
        cls(model_kwargs={"temperature": -2})


@pytest.mark.parametrize("cls", [ChatParaLLM, ParaLLM, ParaLLMLlamaIndex], ids=lambda c: c.__name__)
def test_valid_sampling_constructs_and_loads_nothing(cls):
    llm = cls(temperature=0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.1, presence_penalty=-2,
              frequency_penalty=2, seed=0, stop="###", max_tokens=1)
    assert llm._engine is None


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_validation_and_peeking_load_no_mlx():
    """The integrations check sampling and read the model's recommendation without importing MLX."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from parallm_integrations._common import check_sampling, model_sampling_defaults\n"
        "check_sampling({'temperature': 0.5, 'stop': 'x'})\n"
        "try:\n"
        "    check_sampling({'top_p': 2})\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
        "print(model_sampling_defaults(None))\n"
        "print('mlx.core' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines() == ["top_p must be <= 1.0, got 2", str(SMOL_DEFAULTS), "False"]


def test_parallm_generate_uses_the_model_defaults_unless_given(engine_03, model_dir_03, monkeypatch, capsys):
    from parallm_engine.cli import main

    submitted = []
    real_submit = engine_03.submit

    def recording_submit(*args, **kwargs):  # the real submit; keep the handle to read its settings
        submitted.append(real_submit(*args, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(engine_03, "submit", recording_submit)
    assert main(["generate", "--model", str(model_dir_03), "--max-tokens", "2", "Hi"]) == 0
    assert main(["generate", "--model", str(model_dir_03), "--max-tokens", "2", "--temperature", "0", "Hi"]) == 0
    capsys.readouterr()
    assert [h.request.params.temperature for h in submitted] == [0.3, 0.0]
