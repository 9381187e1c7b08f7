//! vLLM versions.
