"""Where every engine's KV lives: its KV-cache events (vLLM's ZMQ publisher) kept as an index."""
