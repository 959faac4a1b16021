"""A Torchtitan client of four CPU ranks (gloo; FSDP=2 x TP=2, torchtitan's 2-D layout: its TP
plan over the `tp` dimension, then FSDP2 over its `fsdp` dimension as `parallelize_llama` /
`parallelize_deepseekv3` do) against a one-rank client on the same batches, for three steps
(`tests/modeling/parallel_ranks.py`, run `tp-fsdp-torchtitan`). Needs the torchtitan extra.

What holds, and why, as for TP alone (tests/modeling/test_parallel_ranks.py): both clients
apply the same aggregate, and DisTrO runs on the gathered full tensors, so the parameters are
the one-rank bits after every apply and the checkpoints the same bytes; given the same
gradients and momentum, `generate` and an apply are exact. The trained gradients are not the
one-rank bits (the row-parallel matmuls and the vocabulary-split embedding add their halves in
another order), which the 1-bit top-k payload hides except at a near tie at the top-k boundary.
DiLoCo is not built on tensor-parallel parameters: refused in one line (FSDP runs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from psyche.core.definitions import ConstantLR, LearningRateSchedule, OptimizerDefinition
from psyche.modeling import torchtitan
from psyche.modeling.causal_lm import CausalLM, ModelOptions
from psyche.modeling.configs import llama_config_dict
from psyche.modeling.diloco import DilocoSettings
from psyche.modeling.parallel import ParallelDims, ParallelismError
from psyche.modeling.trainer import Trainer

from .rank_runs import run_ranks

WHY_NOT = torchtitan.available()
# Four rank processes a model: run beside the other whole-system files (e2e phase).
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""), pytest.mark.e2e]
LLAMA3, DEEPSEEK_V3 = "tp-fsdp-torchtitan", "tp-fsdp-torchtitan-deepseek"


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("titan2d")
    return run_ranks(out, "cpu", "tp-fsdp-torchtitan", ranks=4)


def test_llama3_at_fsdp_2_x_tp_2_publishes_and_applies_the_one_rank_bits(
    four_ranks: tuple[dict, Path],
) -> None:
    """llama3: the one-rank payload bytes and parameters at every step (21 parameters: the
    layers' linears and norms, the embedding, the final norm, lm_head)."""
    report = four_ranks[0][LLAMA3]
    assert report["payload_equal"] == [True] * 3
    assert report["results_differ"] == [[]] * 3
    assert report["params_equal"] == [True] * 3
    assert report["exact"]["params"] == 2 * 9 + 3
    assert report["exact"]["grad_equal"] == []  # rounding only: checked close below
    assert_exact(report["exact"])


def test_deepseek_v3_at_fsdp_2_x_tp_2_holds_the_one_rank_bits(
    four_ranks: tuple[dict, Path],
) -> None:
    """deepseek_v3 with MoE (MLA, a dense layer, an MoE layer with routed and shared experts):
    the one-rank parameters after every apply, DisTrO exact given the same gradients; its
    payload is the one-rank bytes at step 1 and, where it is not, differs in a few parameters'
    results only (on this model the dense FFN's w1 at step 2, the routed experts' w2 and the
    router at step 3: a chunk's 4th and 5th largest DCT coefficients within rounding of each
    other keep the other one), as at TP=2 alone."""
    report = four_ranks[0][DEEPSEEK_V3]
    assert report["payload_equal"][0] is True
    assert report["results_differ"][0] == []
    assert all(len(differ) <= 3 for differ in report["results_differ"])
    assert report["params_equal"] == [True] * 3
    for sharded, single in report["loss"]:
        assert sharded == pytest.approx(single, rel=1e-5)
    assert_exact(report["exact"])


def assert_exact(exact: dict) -> None:
    """FSDP shards every parameter; the trained gradients are the one-rank ones within
    rounding; given the one-rank gradients and momentum, DisTrO's generate and apply give the
    one-rank bits."""
    assert exact["sharded_params"] == exact["params"]
    assert 0.0 <= exact["grad_max_abs_diff"] < 1e-5
    assert exact["generate_equal"] is True
    assert exact["apply_equal"] is True


@pytest.mark.parametrize("mode", [LLAMA3, DEEPSEEK_V3])
def test_it_checkpoints_the_one_rank_bytes(four_ranks: tuple[dict, Path], mode: str) -> None:
    out = four_ranks[1]
    files = sorted(p.name for p in (out / mode).iterdir())
    assert files == sorted(p.name for p in (out / f"{mode}-reference").iterdir()) != []
    for name in files:
        assert (out / mode / name).read_bytes() == (out / f"{mode}-reference" / name).read_bytes()


def test_diloco_on_tensor_parallel_parameters_is_one_line() -> None:
    """DiLoCo is not built on TP shards (its outer state and decoded results are whole tensors,
    which it mixes with the parameters: it failed mid-round in its codec): refused as the
    trainer is built, before any rank is needed. Replicated and FSDP data parallelism pass."""
    options = ModelOptions(architecture="Torchtitan", device="cpu")
    model = CausalLM.from_config(llama_config_dict("tiny"), options)
    diloco = OptimizerDefinition.DiLoCo(DilocoSettings(inner_steps=2).definition())
    schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
    cpu = torch.device("cpu")
    for dims in (ParallelDims(cpu, tp=2), ParallelDims(cpu, dp=2, tp=2, fsdp=True)):
        with pytest.raises(ParallelismError, match="DiLoCo is not built on tensor-parallel"):
            Trainer(model, schedule, diloco, 2, parallel=dims)
    ParallelDims(cpu, dp=2).check_optimizer(diloco)
    ParallelDims(cpu, dp=2, fsdp=True).check_optimizer(diloco)
