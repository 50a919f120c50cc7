"""Which buffer each attention kernel wrote, beside the buffer its wrapper handed on and the
buffer o_proj read: the pointers that make the seed bug (a kernel writing a tensor its caller
never read) visible as `buffer-disconnect` in the user's own engine.

Where the kernel's buffer comes from, by engine:

* `hf`: every attention function transformers dispatches to (its AttentionInterface, and the
  modeling file's eager function) is wrapped; the innermost call's output during an attention
  module's forward is the kernel's, also sent as `NAME.attn_kernel`.
* `vllm`: MLAAttention allocates `output` and hands it to `forward_impl` (directly, or through
  the custom op `unified_mla_attention_with_output`, whose body calls the layer's
  `forward_impl`; vLLM 0.33.0 mla_attention.py:829-898,1486-1523). Each module with a
  `forward_impl` has it wrapped per instance, and the `output` it was handed is the kernel's
  buffer. The module's own output frame carries that buffer as `kernel_out_ptr` when the
  module returns the attention output (DeepSeek-V3's `mla_attn.mla_attn`); GLM-5's
  DeepseekV32Attention calls o_proj itself, and o_proj's input says it.
* `sglang`: RadixAttention (`attn_mqa`, `attn_mha`) returns what its attention backend wrote;
  that tensor is the kernel's buffer.

For every engine, a pre-hook on each o_proj sends its input as `O_PROJ.input` with the
buffer of the last kernel before it as `kernel_out_ptr`, when that buffer holds as many values
as o_proj reads (the absorbed path's latent output goes through W_UV first: no claim then). A
copy that holds exactly the kernel's values (a reshape that had to copy) counts as the same
buffer.
"""

import sys

from .tensors import first_tensor, tensor_bytes, wire_dtype


class KernelBuffers:
    """The watch over one model's attention kernels; `undo` removes it."""

    def __init__(self, torch, model, sender, engine):
        self.torch = torch
        self.sender = sender
        self.undo = []
        # id(o_proj) -> the buffer the last attention kernel before it wrote, this forward.
        self.kernel = {}
        # id(attention module) -> the pointer its kernel wrote, for the module's own frame.
        self.own = {}
        self.names = {id(m): n for n, m in model.named_modules() if n}
        # Each module's o_proj: its own, or the nearest ancestor's.
        self.o_proj_of = {}
        self._find_o_projs(model, None)
        if engine == "hf":
            self._watch_hf_functions(model)
        elif engine == "vllm":
            self._watch_forward_impl(model)
        elif engine == "sglang":
            self._watch_radix_attention(model)
        self._watch_o_proj_inputs(model)

    def own_output(self, module):
        """The pointer the kernel of `module` wrote, when `module` returns its output."""
        return self.own.pop(id(module), None)

    def _find_o_projs(self, module, inherited):
        o_proj = getattr(module, "o_proj", None)
        if not isinstance(o_proj, self.torch.nn.Module):
            o_proj = inherited
        self.o_proj_of[id(module)] = o_proj
        for child in module.children():
            self._find_o_projs(child, o_proj)

    def _wrote(self, module, buffer):
        """`module`'s kernel wrote `buffer`."""
        o_proj = self.o_proj_of.get(id(module))
        if o_proj is not None:
            self.kernel[id(o_proj)] = buffer
        if getattr(module, "o_proj", None) is None:
            self.own[id(module)] = buffer.data_ptr()

    def _watch_hf_functions(self, model):
        torch, sender = self.torch, self.sender
        try:
            from transformers.modeling_utils import AttentionInterface
        except ImportError:
            return
        seen = set()  # attention modules whose kernel already reported, this forward

        def wrap(fn):
            def kernel(module, *args, **kwargs):
                out = fn(module, *args, **kwargs)
                t = first_tensor(torch, out)
                name = self.names.get(id(module))
                if t is not None and name is not None and id(module) not in seen:
                    seen.add(id(module))  # the innermost call returns first
                    self._wrote(module, t)
                    dtype = wire_dtype(torch, t)
                    if dtype is not None:
                        sender.tensor(name + ".attn_kernel", dtype, list(t.shape), tensor_bytes(t), ptr=t.data_ptr())
                return out

            kernel.__wrapped__ = fn
            return kernel

        mapping = AttentionInterface._global_mapping
        for key, fn in list(mapping.items()):
            mapping[key] = wrap(fn)
            self.undo.append(lambda key=key, fn=fn: mapping.__setitem__(key, fn))
        for module in {type(m).__module__ for m in model.modules()}:
            mod = sys.modules.get(module)
            fn = getattr(mod, "eager_attention_forward", None)
            if callable(fn):
                setattr(mod, "eager_attention_forward", wrap(fn))
                self.undo.append(lambda mod=mod, fn=fn: setattr(mod, "eager_attention_forward", fn))
        for m in model.modules():
            if isinstance(getattr(m, "o_proj", None), torch.nn.Module):
                h = m.register_forward_pre_hook(lambda mod, args: seen.discard(id(mod)))
                self.undo.append(h.remove)

    def _watch_forward_impl(self, model):
        torch = self.torch
        for m in model.modules():
            fn = getattr(m, "forward_impl", None)
            if not callable(fn):
                continue

            def forward_impl(*args, _fn=fn, _m=m, **kwargs):
                # forward_impl(q, k_c_normed, k_pe, kv_cache, attn_metadata, output, ...)
                out = kwargs.get("output", args[5] if len(args) > 5 else None)
                result = _fn(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    self._wrote(_m, out)
                return result

            m.forward_impl = forward_impl
            self.undo.append(lambda m=m: m.__dict__.pop("forward_impl", None))

    def _watch_radix_attention(self, model):
        for m in model.modules():
            if type(m).__name__ != "RadixAttention":
                continue

            def wrote(module, inputs, output):
                t = first_tensor(self.torch, output)
                if t is not None:
                    self._wrote(module, t)
                    self.own.pop(id(module), None)  # it returns what the backend wrote

            self.undo.append(m.register_forward_hook(wrote).remove)

    def _watch_o_proj_inputs(self, model):
        torch, sender = self.torch, self.sender
        done = set()
        for m in model.modules():
            o_proj = getattr(m, "o_proj", None)
            if not isinstance(o_proj, torch.nn.Module) or id(o_proj) in done:
                continue
            done.add(id(o_proj))
            name = self.names.get(id(o_proj))
            if name is None:
                continue

            def reads(module, args, name=name):
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                k = self.kernel.pop(id(module), None)
                dtype = None if t is None else wire_dtype(torch, t)
                if dtype is None:
                    return
                wrote = None
                if k is not None and k.numel() == t.numel():
                    wrote = k.data_ptr()
                    if wrote != t.data_ptr() and torch.equal(k.reshape(-1), t.reshape(-1)):
                        wrote = t.data_ptr()  # a copy of exactly what the kernel wrote
                sender.tensor(name + ".input", dtype, list(t.shape), tensor_bytes(t), ptr=t.data_ptr(),
                              kernel_out_ptr=wrote)

            self.undo.append(o_proj.register_forward_pre_hook(reads).remove)
