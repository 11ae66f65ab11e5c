"""The HTTP API: SGLang-native endpoints, OpenAI-compatible endpoints, errors and metrics."""
