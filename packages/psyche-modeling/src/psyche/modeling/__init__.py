"""DisTrO, the trainer and model loading for Psyche (upstream `shared/modeling`).

Importing this package is cheap: torch and transformers load when a name is first used.

DisTrO in research code (one process, no network)::

    from psyche.modeling import DistroLoop, DistroSettings, PeerSimulation

    loop = DistroLoop(model, DistroSettings(compression_topk=8, quantize_1bit=True), lr=1e-3)
    for step, (x, y) in enumerate(batches, start=1):
        loop.zero_grad(step)                  # zero grads, apply the lookahead
        loss_fn(model(x), y).backward()
        loop.step(step)                       # compress momentum, apply last step's result

    sim = PeerSimulation([model_a, model_b, model_c], lr=1e-3, through_wire=True)
    for step in range(1, n + 1):
        sim.zero_grad(step)
        for m, (x, y) in zip(sim.models, shards(step)):
            loss_fn(m(x), y).backward()
        sim.step(step)                        # every peer applies every peer's payload

The Psyche client uses the split API instead: `Trainer.train_exact` (lookahead, forward/backward,
`Distro.generate`, the lookahead undone exactly), `Trainer.prepare_result` (the payload and its
commitment hash) and `Trainer.optimize` (`Distro.apply` on the witnessed results), with
`serialized_distro` for the bytes on the wire. The trainer owns a `ParallelDims`: the model's
layout over the client's ranks (data, tensor and fully-sharded parallelism: `sharding` lays the
model out, `distributed` runs the ranks as one).
"""

from __future__ import annotations

from psyche.core.lazy import lazy_exports

_EXPORTS = {
    "get_divisors": ".dct",
    "get_prime_divisors": ".dct",
    "get_smaller_split": ".dct",
    "TransformDCT": ".dct",
    "CompressDCT": ".compression",
    "compress": ".compression",
    "decompress": ".compression",
    "batch_decompress": ".compression",
    "compress_idx": ".compression",
    "decompress_idx": ".compression",
    "Distro": ".distro",
    "DistroResult": ".distro",
    "ResultLayout": ".distro",
    "quantize_results": ".distro",
    "sorted_variables": ".distro",
    "InvalidDistroResult": ".serialized_distro",
    "SerializableTensor": ".serialized_distro",
    "SerializableTensorData": ".serialized_distro",
    "SerializedDistroResult": ".serialized_distro",
    "TransmittableDistroResult": ".serialized_distro",
    "distro_results_from_transmittable": ".serialized_distro",
    "transmittable_distro_result": ".serialized_distro",
    "decode_transmittable": ".serialized_distro",
    "get_lr": ".lr",
    "LibtorchAdamW": ".adamw",
    "CausalLM": ".causal_lm",
    "ModelOptions": ".causal_lm",
    "ModelLoadError": ".causal_lm",
    "ARCHITECTURES": ".causal_lm",
    "save_checkpoint": ".checkpoint",
    "save_tensors_into_safetensors": ".checkpoint",
    "Batch": ".trainer",
    "PreparedResult": ".trainer",
    "Trainer": ".trainer",
    "TrainOutput": ".trainer",
    "ParallelDims": ".parallel",
    "ParallelismError": ".parallel",
    "DistroLoop": ".research",
    "DistroSettings": ".research",
    "PeerSimulation": ".research",
    "llama_config_dict": ".configs",
    "DILOCO_VERIFICATION": ".verification",
    "DISTRO_VERIFICATION": ".verification",
    "DILOCO_SPARSE_VERIFICATION": ".verification",
    "Evidence": ".verification",
    "Recomputed": ".verification",
    "VerificationSettings": ".verification",
    "VerificationVerdict": ".verification",
    "recompute": ".verification",
    "verification_settings": ".verification",
    "verify_result": ".verification",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
