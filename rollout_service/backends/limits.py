"""Limits shared by the transport and the service's settings, kept free of imports so that the
settings (and whatever reads them, such as the CLI's flags) do not load the HTTP stack."""

# What one answer from an env or a model server may hold unless a transport is told otherwise. The
# largest legitimate one is a completion: max_tokens (at most 32,768) times an id, a logprob and its
# text (under 128 bytes a token, written as JSON, with the chat endpoint's per-token entries) for
# each of up to 16 choices is 64 MiB; an env's observation is far below that.
DEFAULT_MAX_ANSWER_BYTES = 64 << 20
