"""The agent lane: attempts whose episodes agent servers run, calling the model through a
per-attempt OpenAI-compatible endpoint (docs/agents.md)."""
