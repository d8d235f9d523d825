"""Rendering a request to the prompt token ids P and D will run."""
