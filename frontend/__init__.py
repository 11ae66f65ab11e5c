"""radixserve's structured-generation DSL, with SGLang's frontend names and semantics.

An SGLang program runs after changing ``import sglang as sgl`` to ``import frontend as sgl``::

    import frontend as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is 2 + 2?")["answer"])

Importing this package never imports torch (the thin client install is httpx, orjson and tqdm).
"""

from frontend.api import (
    SglFunction,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from frontend.backends import (
    BackendError,
    BaseBackend,
    EngineBackend,
    FeatureNotSupported,
    OpenAI,
    Runtime,
    RuntimeEndpoint,
)
from frontend.cache_meter import CacheMeter
from frontend.chat import ChatTemplate, get_chat_template
from frontend.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from frontend.dtypes import DtypeError
from frontend.global_config import GlobalConfig, global_config
from frontend.state import ProgramState, ProgramStateGroup

__all__ = [
    "BackendError", "BaseBackend", "CacheMeter", "ChatTemplate", "ChoicesDecision", "ChoicesSamplingMethod",
    "DtypeError", "EngineBackend", "FeatureNotSupported", "GlobalConfig", "OpenAI", "ProgramState",
    "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin",
    "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string", "get_chat_template",
    "get_default_backend", "get_server_info", "global_config", "greedy_token_selection", "select",
    "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]
