"""Rank 0 -> every worker: the step channel. One message per op (a step's inputs, a page copy, a LoRA adapter's
shard, the rows whose logits are wanted, stop), packed as a fixed header of int64 words (op, two arguments, the
total size, and each tensor's dtype and shape) followed by the tensors' bytes.

Between the ranks rank 0 starts on its host the message is one shared-memory broadcast (parallel/shm.py; the
workers wait for it as long as the server idles, sleeping between checks); a message larger than a slot, and
ranks on other hosts, go through the control group of torch.distributed's backend (no timeout while the server
idles): the header, then the payload in one broadcast. A step's inputs used to be seven broadcasts over gloo
(~0.9 ms each on the TCP loopback here); they are now one message.
"""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist

HEADER = 64                   # int64 words: op, a, b, total bytes, tensors, via-backend flag, 4 per tensor
MAX_TENSORS = (HEADER - 6) // 4
CODES = (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8)


def float_word(x: float) -> int:
    """A float carried in a header word (its IEEE double bits)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def word_float(w: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(w)))[0]


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


class StepChannel:
    def __init__(self, group, control):
        self.group, self.control = group, control

    def send(self, op: int, a: int = 0, b: int = 0, tensors=()) -> None:
        if len(tensors) > MAX_TENSORS:
            raise ValueError(f"step channel: {len(tensors)} tensors in one message (at most {MAX_TENSORS})")
        tensors = [t.detach().contiguous().cpu() for t in tensors]
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0], header[1], header[2], header[4] = op, a, b, len(tensors)
        total = HEADER * 8
        for i, t in enumerate(tensors):
            if t.dim() > 2:
                raise ValueError("step channel: tensors of at most 2 dimensions")
            dims = list(t.shape) + [0] * (2 - t.dim())
            header[6 + 4 * i:10 + 4 * i] = torch.tensor([CODES.index(t.dtype), t.dim(), *dims])
            total += _aligned(t.numel() * t.element_size())
        header[3] = total
        shm = self.group.shm
        if shm is not None and total <= shm.slot_bytes:
            buf = torch.empty(total, dtype=torch.uint8)
            buf[:HEADER * 8] = header.view(torch.uint8)
            off = HEADER * 8
            for t in tensors:
                n = t.numel() * t.element_size()
                buf[off:off + n] = t.view(-1).view(torch.uint8)
                off += _aligned(n)
            shm.broadcast(buf)
            return
        header[5] = 1                 # the payload follows through the backend
        if shm is not None:
            shm.broadcast(header.view(torch.uint8))
        else:
            dist.broadcast(header, src=0, group=self.control)
        if tensors:
            payload = torch.zeros(total - HEADER * 8, dtype=torch.uint8)
            off = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                payload[off:off + n] = t.view(-1).view(torch.uint8)
                off += _aligned(n)
            dist.broadcast(payload, src=0, group=self.control)

    def recv(self) -> tuple[int, int, int, list[torch.Tensor]]:
        """(op, a, b, tensors) of rank 0's next message; waits as long as the server idles."""
        shm = self.group.shm
        if shm is not None:
            raw = shm.broadcast(None, idle=True)
            header = raw[:HEADER * 8].clone().view(torch.int64)
        else:
            raw = None
            header = torch.zeros(HEADER, dtype=torch.int64)
            dist.broadcast(header, src=0, group=self.control)
        h = header.tolist()
        op, a, b, total, count, via_backend = h[:6]
        if count == 0:
            return op, a, b, []
        if via_backend:
            payload = torch.empty(total - HEADER * 8, dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self.control)
        else:
            payload = raw[HEADER * 8:total]
        out, off = [], 0
        for i in range(count):
            code, ndim, d0, d1 = h[6 + 4 * i:10 + 4 * i]
            dtype, shape = CODES[code], [d0, d1][:ndim]
            n = 1
            for d in shape:
                n *= d
            nbytes = n * dtype.itemsize
            out.append(payload[off:off + nbytes].clone().view(dtype).view(shape))
            off += _aligned(nbytes)
        return op, a, b, out
