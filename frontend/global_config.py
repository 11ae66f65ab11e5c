"""Process-wide DSL settings (SGLang's ``sgl.global_config``).

SGLang programs read the default backend through ``sgl.global_config.default_backend`` (e.g. SGLang's own
test programs ask it for ``.endpoint.get_model_name()``), so ``set_default_backend`` stores it here rather
than in a private module variable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    # 0: silent; 2 (or more): print each program's final text when ``run`` returns.
    verbosity: int = 0
    # What ``run``/``run_batch`` use when no ``backend=`` is given.
    default_backend: Any = None
    # Prefill the common prefix of a ``run_batch`` once before the programs fan out.
    enable_precache_with_tracing: bool = True
    # Accepted for SGLang compatibility. Output detokenization is the server's business here, and
    # ``join("concate_and_append")`` always concatenates text (no server moves KV between requests).
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    enable_parallel_encoding: bool = True


global_config = GlobalConfig()
