"""The tokens-only pipeline: a render server renders and derenders, engines started with
``--tokens-only`` see only token ids (docs/tokens-pipeline.md)."""
