"""mladb's hook for a running engine (transformers today; vLLM and SGLang with the name maps):
streams the engine's tensors to `mladb attach` in the frames of `wire`.

    import mladb_hook
    sender = mladb_hook.attach(model, "127.0.0.1:7777")   # or "unix:/tmp/mladb.sock", "file:run.frames"
    model.generate(...)
    sender.close()
"""

from . import wire  # noqa: F401
from .hook import Sender, attach  # noqa: F401
