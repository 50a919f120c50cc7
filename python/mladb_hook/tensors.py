"""Tensor helpers of the hook: the wire's name of a torch dtype, the first tensor of a module's
output, and a tensor's bytes on the host (no numpy needed)."""

import ctypes

_TORCH_DTYPES = None


def wire_dtype(torch, t):
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        _TORCH_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
                         torch.int32: "i32", torch.int64: "i64"}
    return _TORCH_DTYPES.get(t.dtype)


def first_tensor(torch, output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            t = first_tensor(torch, item)
            if t is not None:
                return t
    if hasattr(output, "to_tuple"):
        return first_tensor(torch, output.to_tuple())
    return None


def tensor_bytes(t):
    """The bytes of a tensor, row-major, copied to the host (no numpy needed)."""
    host = t.detach().contiguous().cpu()
    return ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())
