"""Everything GPU-only, checked and measured in one command, ending with a table the docs can paste.

    scripts/gpu.sh                 # on a machine with one CUDA GPU (about 5 minutes on an H100)
    scripts/gpu.sh --dry-run       # the same steps at tiny sizes on the CPU (CI runs this)

Sections, each a figure against a baseline measured in the same run:

1. tests    - every `gpu`-marked test (`pytest -m gpu`), pass/fail per test.
2. ceiling  - the card's own bf16 matrix-product rate (8192^3) and device-to-device copy rate, the
              anchors for everything below (the datasheet's dense bf16 peak is printed beside them).
3. mfu      - model FLOPs utilisation of a 1B Llama (TinyLlama-1.1B shape, bf16, seq 2048): a plain
              PyTorch forward/backward loop (the anchor, no optimizer), the same loop with
              `--fused-loss auto` (Liger's kernel when installed, else the chunked loss), and the
              client's own training step (`Trainer.train` + `optimize` with DisTrO), FLOPs counted as torchtitan does
              (6 x non-embedding parameters + 12 x layers x hidden x seq per token).
4. distro   - DisTrO generate + apply as a share of that step (`scripts/bench/distro.py`'s
              measurement, goal <= 10 %), for the batched route (CUDA's default) against the
              per-parameter route (upstream's op order) in the same run.
5. diloco   - CPU and CUDA take the same DiLoCo outer step bit for bit (from the tests of 1.).
6. round    - round overhead of a real centralized run on this machine (`psyche-server run` and two
              `psyche-client train --device cuda` processes, 20M model; `scripts/bench/round.py`).
7. screening - a witness's checks of an honest round against its training and apply, 20M and 1B
              (`scripts/bench/poison.py --only cost`; goal <= 5 %).

Everything it writes goes to `--out-dir` (default: a temporary directory, printed): the pytest
log and JUnit XML, the round benchmark's log and `gpu-table.md`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]

# Dense bf16 tensor-core peaks from the vendors' datasheets (no sparsity), FLOP/s. The most specific
# name first: an "H100 PCIe" must not match "H100".
DATASHEET_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("GH200", 989.4e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


@dataclass
class Row:
    what: str
    value: str
    goal: str = ""
    verdict: str = ""


@dataclass
class Report:
    device: str
    rows: list[Row] = field(default_factory=list)

    def add(self, what: str, value: str, goal: str = "", verdict: str = "") -> None:
        self.rows.append(Row(what, value, goal, verdict))
        print(f"  {what}: {value}" + (f" (goal {goal}: {verdict})" if goal else ""), flush=True)

    def markdown(self) -> str:
        lines = [
            f"Device: {self.device}",
            "",
            "| what | measured | goal | |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r.what} | {r.value} | {r.goal} | {r.verdict} |" for r in self.rows]
        return "\n".join(lines) + "\n"


def load_bench(name: str) -> ModuleType:
    path = REPO / "scripts" / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "CPU (dry run)"
    props = torch.cuda.get_device_properties(device)
    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    )


def datasheet_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DATASHEET_BF16 if key in name), None)


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


# -- 1. tests -------------------------------------------------------------------------------------


def run_gpu_tests(args: argparse.Namespace, out: Path, report: Report) -> dict[str, str]:
    """Runs `pytest -m gpu` (collection only in a dry run); returns outcome per test id."""
    print("\n## 1. gpu-marked tests", flush=True)
    xml_path = out / "gpu-tests.xml"
    cmd = [
        sys.executable, "-m", "pytest", "-m", "gpu", "tests/modeling", "-q", "-p",
        "no:cacheprovider", f"--junitxml={xml_path}",
    ]  # fmt: skip
    if args.dry_run:
        cmd.append("--collect-only")
    with open(out / "gpu-tests.log", "wb") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    outcomes: dict[str, str] = {}
    if xml_path.exists():
        for case in ET.parse(xml_path).iter("testcase"):
            name = f"{case.get('classname', '')}.{case.get('name', '')}".rsplit(".", 2)
            test_id = ".".join(name[-2:])
            kinds = {child.tag for child in case}
            outcomes[test_id] = (
                "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                else "passed"
            )  # fmt: skip
    counts = {
        k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped")
    }
    if args.dry_run:
        collected = (out / "gpu-tests.log").read_text(errors="replace").count("::")
        report.add(
            "gpu tests collected (dry run)", str(collected), "", verdict(proc.returncode == 0)
        )
        return outcomes
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    report.add(
        "gpu tests",
        summary or "none ran",
        "all pass",
        verdict(counts["failed"] == 0 and counts["passed"] > 0),
    )
    for test_id, outcome in sorted(outcomes.items()):
        if outcome == "failed":
            report.add(f"failed: {test_id}", "see gpu-tests.log")
    return outcomes


# -- 2. ceilings ----------------------------------------------------------------------------------


def timed_median(fn, device: torch.device, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_rate(n: int, device: torch.device) -> float:
    """FLOP/s of an n x n x n matrix product (bf16 on a GPU, fp32 on the CPU), random inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    return 2 * n**3 / timed_median(lambda: a @ b, device, 10)


def copy_rate(size: int, device: torch.device) -> float:
    """Bytes/s of a device-to-device copy of `size` bytes, counting bytes read and written."""
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_(generator=g)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * size / timed_median(lambda: dst.copy_(src), device, 10)


def measure_ceiling(args: argparse.Namespace, device: torch.device, report: Report) -> float:
    print("\n## 2. ceilings of this device", flush=True)
    n = 256 if args.dry_run else 8192
    matmul = matmul_rate(n, device)
    peak = datasheet_peak(device)
    report.add(
        f"{'bf16' if device.type == 'cuda' else 'fp32'} matmul {n}^3",
        f"{matmul / 1e12:.3g} TFLOP/s"
        + (f" ({matmul / peak:.0%} of the datasheet's {peak / 1e12:.0f})" if peak else ""),
    )
    rate = copy_rate((64 if args.dry_run else 4096) * 2**20, device)
    report.add("device-to-device copy (read + write)", f"{rate / 1e9:.0f} GB/s")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return matmul


# -- 3 and 4. MFU and DisTrO's share --------------------------------------------------------------


def flops_per_token(config: dict, seq: int) -> float:  # type: ignore[type-arg]
    """torchtitan's count (`get_num_flop_per_token`): 6 x non-embedding parameters (the input
    embedding does no matmul; the output projection does and counts) + 12 x layers x hidden x seq
    for attention's two sequence-long products, forward and backward."""
    h, inter, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
    )
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    mlp = 3 * h * inter
    per_layer = (
        attn + mlp + 2 * h
    )  # the two RMSNorm weights (elementwise, counted as upstream does)
    non_embedding = layers * per_layer + h + h * config["vocab_size"]
    return 6 * non_embedding + 12 * layers * h * seq


def plain_loop_tokens_per_s(
    distro: ModuleType,
    size: str,
    device: torch.device,
    steps: int,
    batch: int,
    seq: int,
    mbs: int,
    fused_loss: str = "off",
) -> float:
    """The anchor: forward + backward of the same model in a plain loop (no optimizer), the
    median of `steps` timed steps after two warm-up steps; with `fused_loss`, through
    `CausalLM.forward` with that `--fused-loss` (the CPU computes the model's own loss)."""
    model = distro.build(size, str(device))
    model.set_fused_loss(fused_loss)
    data = distro.bigram_corpus((steps + 2) * batch, seq, model.config.vocab_size).to(device)
    hf = model.model
    hf.train()

    def fwd_bwd(step: int) -> None:
        rows = data[step * batch : (step + 1) * batch]
        for chunk in rows.split(mbs):
            if fused_loss == "off":
                loss = hf(input_ids=chunk, labels=chunk).loss
            else:
                loss = model.forward(chunk, labels=chunk)[1]
            (loss * chunk.shape[0] / batch).backward()
        hf.zero_grad(set_to_none=True)

    for step in range(2):
        fwd_bwd(step)
    secs = statistics.median(
        timed_median(lambda s=s: fwd_bwd(s), device, 1) for s in range(2, steps + 2)
    )
    return batch * seq / secs


def measure_mfu(
    args: argparse.Namespace, device: torch.device, matmul: float, report: Report
) -> None:
    distro = load_bench("distro")
    size = "tiny" if args.dry_run else args.mfu_size
    seq = 32 if args.dry_run else args.seq
    batch, mbs = (4, 2) if args.dry_run else (args.batch, args.micro_batch)
    steps = 2 if args.dry_run else args.steps
    from psyche.modeling.configs import llama_config_dict

    config = llama_config_dict(size)
    per_token = flops_per_token(config, seq)
    peak = datasheet_peak(device)

    def mfu(tokens_per_s: float) -> str:
        achieved = tokens_per_s * per_token
        text = f"{achieved / 1e12:.3g} TFLOP/s, {achieved / matmul:.0%} of the measured matmul"
        return text + (f", **MFU {achieved / peak:.1%}**" if peak else "")

    print(
        f"\n## 3. MFU: {size} Llama, {batch} x {seq} tokens a step, micro-batch {mbs}", flush=True
    )
    anchor = plain_loop_tokens_per_s(distro, size, device, steps, batch, seq, mbs)
    report.add(f"plain forward+backward, {size}", f"{anchor:,.0f} tok/s; {mfu(anchor)}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    from psyche.modeling.fused_loss import resolve

    fused = plain_loop_tokens_per_s(distro, size, device, steps, batch, seq, mbs, "auto")
    report.add(
        f"plain forward+backward, {size}, --fused-loss auto ({resolve('auto', device)})",
        f"{fused:,.0f} tok/s ({fused / anchor:.2f} of the plain loop); {mfu(fused)}",
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()

    from psyche.modeling import distro as distro_module

    # DisTrO's per-parameter route (upstream's op order; the CPU's default) as the baseline of
    # the batched route (the default on CUDA), same model, batches and sitting
    shares = {}
    for route, batched in (("per-parameter", False), ("batched", True)):
        distro_module.BATCHED_ROUTE = batched
        try:
            shares[route] = distro.measure_distro_share(size, str(device), steps, batch, seq, mbs)
        finally:
            distro_module.BATCHED_ROUTE = None
    step_ms, distro_ms = shares["batched"]
    client = batch * seq / (step_ms / 1e3)
    goal_mfu = 0.40
    achieved = client * per_token
    report.add(
        f"client training step (DisTrO), {size}",
        f"{client:,.0f} tok/s ({client / anchor:.2f} of the plain loop); {mfu(client)}",
        f"MFU >= {goal_mfu:.0%}" if peak else "",
        verdict(achieved / peak >= goal_mfu) if peak else "",
    )
    print(f"\n## 4. DisTrO's share of the {size} step", flush=True)
    base_step, base_distro = shares["per-parameter"]
    report.add(
        f"DisTrO generate+apply share of the {size} step, per-parameter route (baseline)",
        f"{base_distro / base_step:.1%} ({base_distro:.1f} of {base_step:.1f} ms)",
    )
    share = distro_ms / step_ms
    report.add(
        f"DisTrO generate+apply share of the {size} step, batched route",
        f"{share:.1%} ({distro_ms:.1f} of {step_ms:.1f} ms; DisTrO {distro_ms / base_distro:.2f}x "
        "the baseline's time)",
        "<= 10 %",
        verdict(share <= 0.10),
    )


# -- 5. DiLoCo agreement --------------------------------------------------------------------------


def diloco_agreement(args: argparse.Namespace, outcomes: dict[str, str], report: Report) -> None:
    print("\n## 5. DiLoCo: CPU and CUDA take the same outer step", flush=True)
    name = "cpu_and_cuda_take_the_same_outer_step"
    cases = {k: v for k, v in outcomes.items() if name in k}
    if args.dry_run:
        log = (args.out_dir_resolved / "gpu-tests.log").read_text(errors="replace")
        report.add("DiLoCo CPU/CUDA bit agreement (dry run)", f"{log.count(name)} cases collected")
        return
    passed = sum(1 for v in cases.values() if v == "passed")
    report.add(
        "DiLoCo CPU/CUDA bit agreement (bf16, int8, sparse payloads)",
        f"{passed} of {len(cases)} transmissions identical",
        "all",
        verdict(bool(cases) and passed == len(cases)),
    )


# -- 6. round overhead ----------------------------------------------------------------------------


def round_overhead(
    args: argparse.Namespace, device: torch.device, out: Path, report: Report
) -> None:
    print("\n## 6. round overhead of a real centralized run", flush=True)
    if args.dry_run:
        extra = [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--clients",
            "2",
            "--rounds",
            "1",
            "--timeout",
            "240",
        ]
    else:
        extra = [
            "--model", "20m", "--device", "cuda", "--clients", "2", "--rounds", str(args.rounds),
            "--batch", str(args.round_batch), "--seq-len", "2048", "--micro-batch-size", "8",
            "--timeout", str(args.round_timeout),
        ]  # fmt: skip
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "round.py"), *extra]
    log = out / "round.log"
    with open(log, "wb") as handle:
        proc = subprocess.run(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, check=False)
    lines = log.read_text(errors="replace").splitlines()

    def figure(prefix: str) -> str:
        """The rest of the first line starting with `prefix` (after its colon, or its median)."""
        found = next((ln.strip() for ln in lines if ln.strip().startswith(prefix)), "")
        if prefix.endswith(":") or ":" not in found:
            return " ".join(found.removeprefix(prefix).split()[:1])
        return found.split(":", 1)[1].strip()

    def row_median(key: str) -> str:
        """The median column of the benchmark's table row `key`."""
        row = next(
            (ln.split() for ln in lines if ln.split()[:1] == [key] and len(ln.split()) == 3), []
        )
        return row[1] if row else "?"

    if proc.returncode != 0:
        report.add("round overhead", f"the run failed (exit {proc.returncode}); see round.log")
        return
    label = (
        "round overhead, tiny on the CPU (dry run)"
        if args.dry_run
        else (f"round overhead, 20M, 2 clients on one GPU, batch {args.round_batch} x 2048")
    )
    report.add(
        label,
        f"round {row_median('round')} s (median); overhead {figure('overhead =')}; "
        f"client compute besides fwd/bwd {figure('compute overhead')}",
    )


# -- 7. the witness checks' cost -------------------------------------------------------------------


def screening_cost(
    args: argparse.Namespace, device: torch.device, out: Path, report: Report
) -> None:
    """`scripts/bench/poison.py --only cost` on this device: a witness's checks of an honest
    round against its training and apply (goal <= +5 %)."""
    print("\n## 7. the witness checks' cost on an honest round", flush=True)
    if args.dry_run:
        extra = ["--cost-sizes", "tiny", "--cost-rounds", "2", "--cost-device", "cpu"]
    else:
        extra = [
            "--cost-sizes", "20m,1b", "--cost-rows", "8", "--cost-seq", "2048",
            "--cost-rounds", "3", "--cost-device", "cuda",
        ]  # fmt: skip
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "poison.py"), "--only", "cost", *extra]
    log = out / "screening.log"
    with open(log, "wb") as handle:
        proc = subprocess.run(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        report.add("witness checks' cost", f"the benchmark failed (exit {proc.returncode})")
        return
    for line in log.read_text(errors="replace").splitlines():
        cells = line.split()
        if len(cells) >= 6 and cells[-1].endswith("%") and cells[0] in ("tiny", "20m", "1b"):
            share = float(cells[-1].rstrip("%")) / 100
            report.add(
                f"witness checks' cost, {cells[0]} {' '.join(cells[1:-4])}",
                f"{share:.1%} of the round's training + apply ({cells[-2]} ms)",
                "<= 5 %",
                verdict(share <= 0.05),
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (for CI)")
    parser.add_argument("--out-dir", type=Path, help="where logs and gpu-table.md go")
    parser.add_argument(
        "--only", default="tests,ceiling,mfu,diloco,round,screening", help="comma list of sections"
    )
    parser.add_argument("--mfu-size", default="1b", choices=("20m", "1b"))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--round-batch", type=int, default=32)
    parser.add_argument("--round-timeout", type=int, default=180)
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu: error: no CUDA device here (use --dry-run to check the script)")
    device = torch.device("cpu" if args.dry_run else "cuda")
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="psyche-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    args.out_dir_resolved = out
    only = set(args.only.split(","))
    report = Report(device_name(device))
    print(f"gpu: {report.device}; logs in {out}", flush=True)
    started = time.monotonic()
    outcomes = run_gpu_tests(args, out, report) if "tests" in only or "diloco" in only else {}
    matmul = measure_ceiling(args, device, report) if "ceiling" in only or "mfu" in only else 0.0
    if "mfu" in only:
        measure_mfu(args, device, matmul, report)
    if "diloco" in only:
        diloco_agreement(args, outcomes, report)
    if "screening" in only:
        screening_cost(args, device, out, report)
    if "round" in only:  # last: the longest, and what a GPU changes least
        round_overhead(args, device, out, report)
    table = report.markdown()
    (out / "gpu-table.md").write_text(table)
    print(f"\n## Table ({time.monotonic() - started:.0f} s; also in {out / 'gpu-table.md'})\n")
    print(table, flush=True)
    failed = any(r.verdict == "**missed**" and r.what.startswith("gpu tests") for r in report.rows)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
