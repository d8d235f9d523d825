"""The engine client: the bytes to and from vLLM instances, and the figures read off their /metrics."""
