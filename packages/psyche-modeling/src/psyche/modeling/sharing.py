"""Model parameters as P2P model sharing carries them, and the model hash (upstream: tch
archives in `p2p_model_sharing.rs`).

`TENSOR_CODEC` is the codec the client hands psyche.network's model sharing
(`NetworkConnection.open(..., model_codec=TENSOR_CODEC)`), as it hands it the DisTrO payload
type: the network moves opaque bytes and never imports torch. A parameter travels as a
single-tensor safetensors file (decoding hostile bytes never runs pickle); bytes that are not one
are a `ValueError`.

`model_hash` is how clients compare weights (the `loaded_model` and `cooldown_model` events, the
tests): equal hashes, bit-identical tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

_TENSOR_KEY = "value"


class TensorCodec:
    """One tensor <-> the bytes of a one-tensor safetensors file."""

    def encode(self, tensor: torch.Tensor) -> bytes:
        from safetensors.torch import save

        return save({_TENSOR_KEY: tensor.detach().to("cpu").contiguous()})

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        """The tensor; `ValueError` for bytes that are not a one-tensor safetensors file."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(bytes(data))
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise ValueError(str(e)) from e
        if set(tensors) != {_TENSOR_KEY}:
            raise ValueError("expected exactly one tensor")
        return tensors[_TENSOR_KEY]


TENSOR_CODEC = TensorCodec()


def model_hash(parameters: Mapping[str, torch.Tensor]) -> bytes:
    """SHA-256 over every parameter (sorted by name): name, dtype, shape and raw bytes.

    Two models with equal hashes hold bit-identical tensors.
    """
    hasher = hashlib.sha256()
    for name in sorted(parameters):
        tensor = parameters[name].detach().to("cpu").contiguous()
        hasher.update(name.encode("utf-8") + b"\0")
        hasher.update(f"{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
        hasher.update(_raw_bytes(tensor))
    return hasher.digest()


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.reshape(-1)
    if flat.dtype in (torch.bfloat16, torch.float16):
        flat = flat.view(torch.int16)
    elif flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.numpy().tobytes()


__all__ = ["TENSOR_CODEC", "TensorCodec", "model_hash"]
