"""Model backends of the DSL. EngineBackend is importable from here without importing torch: the runtime
is imported only when one is constructed."""

from frontend.backends.base import BackendError, BaseBackend, FeatureNotSupported
from frontend.backends.engine import EngineBackend
from frontend.backends.openai import OpenAI
from frontend.backends.runtime_endpoint import Runtime, RuntimeEndpoint

__all__ = ["BackendError", "BaseBackend", "EngineBackend", "FeatureNotSupported", "OpenAI", "Runtime",
           "RuntimeEndpoint"]
