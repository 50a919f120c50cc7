"""mladb's hook for a running engine (vLLM, SGLang, transformers): streams the engine's tensors
to `mladb attach` in the frames of `wire`. So far the package holds the frame writer; the hook
that registers itself on a model comes with the attach server."""

from . import wire  # noqa: F401
