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

import queue
import socket
import threading

from . import buffers, wire
from .tensors import first_tensor, tensor_bytes, wire_dtype

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

    kernels = buffers.KernelBuffers(torch, model, sender, engine)

    def on_output(module_name):
        def send(module, inputs, output):
            t = first_tensor(torch, output)
            if t is None:
                return
            dtype = wire_dtype(torch, t)
            if dtype is None:
                return
            sender.tensor(module_name, dtype, list(t.shape), tensor_bytes(t), ptr=t.data_ptr(),
                          kernel_out_ptr=kernels.own_output(module))

        return send

    handles = [model.register_forward_pre_hook(on_step, with_kwargs=True)]
    handles += [m.register_forward_hook(on_output(n)) for n, m in model.named_modules() if n]
    restore = kernels.undo
    close = sender.close

    def close_and_detach():
        for h in handles:
            h.remove()
        for undo in restore:
            undo()
        close()

    sender.close = close_and_detach
    return sender
