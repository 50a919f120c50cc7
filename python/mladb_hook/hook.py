"""The hook: streams a running model's tensors to `mladb attach` (or into a file of frames).

`Sender` is the transport, standard library only: a bounded queue drained by one background
thread that writes frames to a socket (`HOST:PORT` or `unix:PATH`) or a file. When the queue
is full, `policy="block"` makes the model wait and `policy="drop"` drops the tensor and counts
it (the count goes out in the closing `bye`).

`attach(model, address, ...)` registers forward hooks on every named submodule of a torch
model: each module's first tensor output goes out as a `tensor` frame, and each forward pass of
the model itself as a `step` frame (its input ids and positions) before them. It returns the
`Sender`; call `close()` when done (or use it as a context manager).
"""

import ctypes
import queue
import socket
import threading

from . import wire

_STOP = object()


class Sender:
    """Frames out to mladb in order, from any thread, with a bounded queue."""

    def __init__(self, address, engine, model, rank=0, world_size=1, queue_size=64, policy="block"):
        if policy not in ("block", "drop"):
            raise ValueError(f"mladb hook: policy must be 'block' or 'drop', not {policy!r}")
        self.policy = policy
        self.dropped = 0
        self.error = None
        self._queue = queue.Queue(maxsize=max(1, int(queue_size)))
        self._out = _open(address)
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name="mladb-hook", daemon=True)
        self._thread.start()
        self._put(wire.hello(engine, str(model), int(rank), int(world_size)), always=True)

    def step(self, phase, step_index, tokens, positions):
        self._put(wire.step(phase, step_index, tokens, positions), always=True)

    def tensor(self, module, dtype, shape, data, ptr=None, kernel_out_ptr=None):
        self._put(wire.tensor(module, dtype, shape, data, ptr=ptr, kernel_out_ptr=kernel_out_ptr))

    def close(self):
        """Sends `bye` (with the dropped count), waits for the queue to drain, closes."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(("bye", None))
        self._queue.put(_STOP)
        self._thread.join()
        self._out.close()
        if self.error is not None:
            raise RuntimeError(f"mladb hook: sending failed: {self.error}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _put(self, frame, always=False):
        if self._closed:
            raise RuntimeError("mladb hook: the sender is closed")
        if self.error is not None:
            raise RuntimeError(f"mladb hook: sending failed: {self.error}")
        if self.policy == "drop" and not always:
            try:
                self._queue.put_nowait(frame)
            except queue.Full:
                self.dropped += 1
        else:
            self._queue.put(frame)

    def _drain(self):
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self.error is not None:
                continue  # keep draining so that producers never block on a dead connection
            try:
                if isinstance(item, tuple):  # the bye, made here so that it counts every drop
                    item = wire.bye(self.dropped)
                self._out.write(item)
            except OSError as e:
                self.error = e


class _SocketOut:
    def __init__(self, sock):
        self.sock = sock

    def write(self, data):
        self.sock.sendall(data)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.sock.close()


class _FileOut:
    def __init__(self, path):
        self.file = open(path, "wb")

    def write(self, data):
        self.file.write(data)

    def close(self):
        self.file.close()


def _open(address):
    """`HOST:PORT`, `unix:PATH`, or `file:PATH` (frames written to a file)."""
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address[len("unix:"):])
        return _SocketOut(sock)
    if address.startswith("file:"):
        return _FileOut(address[len("file:"):])
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"mladb hook: address {address!r} is not HOST:PORT, unix:PATH or file:PATH")
    return _SocketOut(socket.create_connection((host.strip("[]"), int(port))))


# ---- torch: the part that needs it is imported only when attach() is called.

_TORCH_DTYPES = None


def _wire_dtype(torch, t):
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        _TORCH_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
                         torch.int32: "i32", torch.int64: "i64"}
    return _TORCH_DTYPES.get(t.dtype)


def _first_tensor(torch, output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            t = _first_tensor(torch, item)
            if t is not None:
                return t
    if hasattr(output, "to_tuple"):
        return _first_tensor(torch, output.to_tuple())
    return None


def _tensor_bytes(t):
    """The bytes of a tensor, row-major, copied to the host (no numpy needed)."""
    host = t.detach().contiguous().cpu()
    return ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())


def attach(model, address, engine="hf", rank=None, world_size=None, queue_size=64, policy="block"):
    """Hooks every named submodule of `model` (a torch.nn.Module) and streams its outputs.

    rank / world_size default to torch.distributed's, or 0 / 1. Each forward pass of `model`
    sends a `step` (phase `prefill` when it sees more than one token per sequence, `decode`
    otherwise) with the input ids and positions it was given, then every module's output in
    the order the modules ran.
    """
    import torch

    if rank is None or world_size is None:
        dist = getattr(torch, "distributed", None)
        ready = dist is not None and dist.is_available() and dist.is_initialized()
        rank = rank if rank is not None else (dist.get_rank() if ready else 0)
        world_size = world_size if world_size is not None else (dist.get_world_size() if ready else 1)
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    sender = Sender(address, engine, name, rank=rank, world_size=world_size, queue_size=queue_size, policy=policy)
    steps = [0]

    def on_step(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            return
        flat = ids.reshape(-1).tolist()
        # transformers passes position_ids; vLLM and SGLang pass positions (vLLM: the second
        # positional argument of the model's forward).
        positions = kwargs.get("position_ids", kwargs.get("positions"))
        if positions is None and engine != "hf" and len(args) > 1:
            positions = args[1]
        if isinstance(positions, torch.Tensor):
            pos = positions.reshape(-1).tolist()
        else:
            cache = kwargs.get("past_key_values")
            start = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
            pos = [start + i for i in range(ids.shape[-1])] * (ids.numel() // max(1, ids.shape[-1]))
        phase = "prefill" if ids.shape[-1] > 1 else "decode"
        sender.step(phase, steps[0], flat, pos)
        steps[0] += 1

    def on_output(module_name):
        def send(module, inputs, output):
            t = _first_tensor(torch, output)
            if t is None:
                return
            dtype = _wire_dtype(torch, t)
            if dtype is None:
                return
            sender.tensor(module_name, dtype, list(t.shape), _tensor_bytes(t), ptr=t.data_ptr())

        return send

    handles = [model.register_forward_pre_hook(on_step, with_kwargs=True)]
    handles += [m.register_forward_hook(on_output(n)) for n, m in model.named_modules() if n]
    restore = _watch_attention_kernels(torch, model, sender) if engine == "hf" else []
    close = sender.close

    def close_and_detach():
        for h in handles:
            h.remove()
        for undo in restore:
            undo()
        close()

    sender.close = close_and_detach
    return sender


def _watch_attention_kernels(torch, model, sender):
    """transformers: the buffer each attention kernel wrote, beside the buffer o_proj read.

    Every attention function transformers dispatches to (its AttentionInterface, and the
    modeling file's eager function) is wrapped: the output of the innermost call during an
    attention module's forward is the kernel's, sent as `NAME.attn_kernel`. A pre-hook on the
    module's o_proj sends o_proj's input as `NAME.o_proj.input`, with the kernel's buffer as its
    `kernel_out_ptr`: a wrapper between them that hands on another buffer (the seed bug: the
    kernel wrote a tensor the caller never read) shows as two pointers that differ. A copy that
    holds exactly the kernel's values (a reshape that had to copy) counts as the same buffer.
    Returns the undo functions.
    """
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return []
    names = {id(m): n for n, m in model.named_modules() if n}
    kernel_out = {}  # id(attention module) -> its kernel's output, this forward (until o_proj reads)
    undo = []

    def wrap(fn):
        def kernel(module, *args, **kwargs):
            out = fn(module, *args, **kwargs)
            t = _first_tensor(torch, out)
            name = names.get(id(module))
            if t is not None and name is not None and id(module) not in kernel_out:
                kernel_out[id(module)] = t  # the innermost call returns first
                dtype = _wire_dtype(torch, t)
                if dtype is not None:
                    sender.tensor(name + ".attn_kernel", dtype, list(t.shape), _tensor_bytes(t), ptr=t.data_ptr())
            return out

        kernel.__wrapped__ = fn
        return kernel

    mapping = AttentionInterface._global_mapping
    for key, fn in list(mapping.items()):
        mapping[key] = wrap(fn)
        undo.append(lambda key=key, fn=fn: mapping.__setitem__(key, fn))
    import sys

    for module in {type(m).__module__ for m in model.modules()}:
        mod = sys.modules.get(module)
        fn = getattr(mod, "eager_attention_forward", None)
        if callable(fn):
            setattr(mod, "eager_attention_forward", wrap(fn))
            undo.append(lambda mod=mod, fn=fn: setattr(mod, "eager_attention_forward", fn))

    for name, attn in model.named_modules():
        o_proj = getattr(attn, "o_proj", None)
        if not name or not isinstance(o_proj, torch.nn.Module):
            continue

        def starts(module, args, key=id(attn)):
            kernel_out.pop(key, None)

        def reads(module, args, key=id(attn), name=name):
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            dtype = None if t is None else _wire_dtype(torch, t)
            k = kernel_out.pop(key, None)
            if dtype is None:
                return
            wrote = None if k is None else k.data_ptr()
            if k is not None and wrote != t.data_ptr() and k.numel() == t.numel() and torch.equal(k.reshape(-1), t.reshape(-1)):
                wrote = t.data_ptr()  # a copy of exactly what the kernel wrote (a reshape), not another buffer
            sender.tensor(name + ".o_proj.input", dtype, list(t.shape), _tensor_bytes(t), ptr=t.data_ptr(),
                          kernel_out_ptr=wrote)

        handles = [attn.register_forward_pre_hook(starts), o_proj.register_forward_pre_hook(reads)]
        undo += [h.remove for h in handles]
    return undo
