"""GPU check of the trainer on one CUDA machine (run by ``benchmarks/gpu_check.sh``; under 8 minutes on one
H100/H200-class GPU):

1. equality: one packed micro-batch through a tiny model twice, by Transformer Engine's THD attention
   (cu_seqlens) and by the block-diagonal mask on megatron-core's local attention (same weights); loss and
   gradients must agree (bf16 tolerances);
2. throughput: bf16 training steps of a ~0.5B-parameter random ``qwen2_5_vl`` at seq 8192 (synthetic packed
   bins), printing tokens/s, model TFLOPs per GPU and MFU (formula: ``trainer/observability.py``);
3. save/load/resume: a run saved at iteration 2 and resumed continues with the uninterrupted run's losses;
4. context parallelism: the same four steps at CP 2 (two ranks; TE's THD attention with ``--cp-comm-type p2p``
   and the per-sample 2xCP split) against the uninterrupted run at CP 1, losses and gradient norms within bf16
   tolerance (needs 2 GPUs on the machine: reported as skipped on one).

``--dry-run`` runs all of it on CPU (gloo, fp32, tiny sizes, the mask path twice instead of THD), so CI keeps
the script working; there the throughput figures come from phase 3's uninterrupted run (the same tiny model at
the same length), one launch fewer. Prints one table; writes benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ~0.47B parameters: 24 x (GQA attention + SwiGLU 4096) at hidden 1024, a 4-layer vision tower of 512
MODEL_GPU = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--num-query-groups",
             "2", "--ffn-hidden-size", "4096", "--vision-num-layers", "4", "--vision-hidden-size", "512",
             "--vision-num-attention-heads", "8"]  # fmt: skip
MODEL_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
              "--vision-num-layers", "1", "--vision-hidden-size", "32", "--vision-num-attention-heads", "2"]  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(args: list[str], *, timeout_s: int, nproc: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_port()), *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_check: {' '.join(args[:3])} failed:\n{proc.stderr[-4000:]}")
    return proc


def _train(
    flags: list[str], work: Path, name: str, *, timeout_s: int, nproc: int = 1
) -> list[dict[str, Any]]:
    metrics = work / f"{name}.jsonl"
    _torchrun(
        ["-m", "mmpack.trainer.pretrain_vlm", *flags, "--metrics-file", str(metrics)], timeout_s=timeout_s,
        nproc=nproc,
    )  # fmt: skip
    return [m for m in map(json.loads, metrics.read_text().splitlines()) if "loss" in m]


# -- phase 1: runs inside one torchrun process --------------------------------------------------------------


def _loss_and_grads(trainer: Any, model: Any, batch: Any, use_thd: bool) -> tuple[float, Any]:
    import torch

    from mmpack.trainer.checkpoint import bare_module
    from mmpack.trainer.data import model_inputs

    bare = bare_module(model)
    bare.zero_grad(set_to_none=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b = batch.map_arrays(lambda v: v.to(device))
    inputs = model_inputs(b, use_thd=use_thd)
    mask = b.loss_mask.reshape(-1).float()
    loss = (model(**inputs).float().reshape(-1) * mask).sum() / mask.sum()
    params = [p for p in bare.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).float().reshape(-1)
            for g, p in zip(grads, params, strict=True)
        ]
    )
    return float(loss), flat


def equality_worker(dry_run: bool) -> None:
    """THD (TE) vs block mask (local attention) on the same weights; prints one JSON line."""
    import torch

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.build import build_model
    from mmpack.trainer.training import Trainer, shutdown

    flags = ["--mock-data", "--seq-length", "512", "--num-workers", "0", "--seed", "7", *MODEL_TINY]
    cpu_backend.activate()  # the benchmark is the entry point: it sets up the CPU backend (no CUDA)
    trainer = Trainer(parse_args(flags + ([] if dry_run else ["--bf16"])))
    batches, _ = trainer.train_data.next_step()
    batch = batches[0]
    (mask_model,) = build_model(trainer.cfg, trainer.mcfg, trainer.arch, use_te=False)  # one chunk (no VP)
    ref_loss, ref_grad = _loss_and_grads(trainer, mask_model, batch, use_thd=False)
    if trainer.use_te:
        other = "THD (Transformer Engine)"
        loss, grad = _loss_and_grads(trainer, trainer.model, batch, use_thd=True)
    else:  # dry run: no TE, the same path again (checks the harness, not THD)
        other = "block mask again (no Transformer Engine)"
        loss, grad = _loss_and_grads(trainer, trainer.model, batch, use_thd=False)
    cos = float(torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0))
    rel = abs(loss - ref_loss) / abs(ref_loss)
    grad_rel = float((grad - ref_grad).norm() / ref_grad.norm())
    print(json.dumps({"compared": other, "loss_mask": ref_loss, "loss_other": loss, "loss_rel_diff": rel,
                      "grad_rel_diff": grad_rel, "grad_cosine": cos}))  # fmt: skip
    shutdown()


# -- the driver ---------------------------------------------------------------------------------------------


def run(dry_run: bool, out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"dry_run": dry_run, "machine": platform.node()}
    start = time.perf_counter()
    proc = _torchrun([__file__, "--equality-worker", *(["--dry-run"] if dry_run else [])], timeout_s=300)
    eq = json.loads(proc.stdout.strip().splitlines()[-1])
    tol = (1e-5, 1e-4) if dry_run else (2e-2, 5e-2)  # fp32 on CPU; bf16 kernels on GPU
    eq["ok"] = eq["loss_rel_diff"] < tol[0] and eq["grad_rel_diff"] < tol[1]
    results["equality"] = eq

    small = ["--mock-data", "--seq-length", "256" if dry_run else "1024", "--num-workers", "0", "--seed", "3",
             "--lr", "1e-3", *MODEL_TINY, *precision(dry_run), "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "4"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # the uninterrupted run: saved at iteration 2, the reference of the resume and of CP 2
        ckpt = work / "ckpt"
        full = _train([*small, "--save", str(ckpt), "--save-interval", "2"], work, "full", timeout_s=300)
        # on CPU the throughput phase would train the same tiny model at the same length: its figures come from
        # the uninterrupted run instead of a launch of their own
        steps = full if dry_run else _throughput_steps(work)
        timed = steps[2:] or steps
        results["throughput"] = {
            "seq_length": 256 if dry_run else 8192,
            "tokens_per_s": sum(m["tokens_per_s"] for m in timed) / len(timed),
            "tflops_per_gpu": sum(m["tflops_per_gpu"] for m in timed) / len(timed),
            "mfu": None if timed[0].get("mfu") is None else sum(m["mfu"] for m in timed) / len(timed),
            "step_ms": sum(m["step_ms"] for m in timed) / len(timed),
            "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]],
            "from": "the uninterrupted run of phase 3" if dry_run else "its own run",
        }
        (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
        resumed = _train([*small, "--load", str(ckpt)], work, "resumed", timeout_s=300)
        diffs = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(resumed, full[2:], strict=True)]
        results["resume"] = {
            "iterations": [m["iteration"] for m in resumed],
            "max_rel_loss_diff": max(diffs),
            "same_data": [m["data_digest"] for m in resumed] == [m["data_digest"] for m in full[2:]],
        }
        results["resume"]["ok"] = results["resume"]["same_data"] and max(diffs) < (1e-6 if dry_run else 1e-3)
        results["context_parallel"] = context_parallel_check(dry_run, small, full, work)
    results["wall_s"] = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return results


def precision(dry_run: bool) -> list[str]:
    return [] if dry_run else ["--bf16", "--use-distributed-optimizer"]


def _throughput_steps(work: Path) -> list[dict[str, Any]]:
    """Phase 2 on a GPU: bf16 steps of the ~0.5B model at seq 8192."""
    flags = ["--mock-data", "--seq-length", "8192", "--num-workers", "0", "--seed", "3", "--lr", "1e-4",
             *MODEL_GPU, *precision(False), "--train-iters", "8"]  # fmt: skip
    return _train(flags, work, "throughput", timeout_s=420)


def context_parallel_check(
    dry_run: bool, small: list[str], ref: list[dict[str, Any]], work: Path
) -> dict[str, Any]:
    """Phase 4: CP 2 against CP 1 (the uninterrupted run ``ref``) on the same synthetic packed bins (2
    micro-batches of 2 bins per step)."""
    import torch

    if not dry_run and torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": f"needs 2 GPUs, the machine has {torch.cuda.device_count()}"}
    cp2 = _train([*small, "--context-parallel-size", "2", "--cp-comm-type", "p2p"], work, "cp2", timeout_s=300,
                 nproc=2)  # fmt: skip
    loss = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(cp2, ref, strict=True))
    norm = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(cp2, ref, strict=True))
    tol = 1e-5 if dry_run else 2e-2
    return {"max_rel_loss_diff": loss, "max_rel_grad_norm_diff": norm, "ok": loss < tol and norm < tol * 5,
            "attention": "all-gather K/V (CPU)" if dry_run else "TE THD p2p"}  # fmt: skip


def print_table(r: dict[str, Any]) -> None:
    eq, tp, rs = r["equality"], r["throughput"], r["resume"]
    mfu = "n/a (CPU)" if tp["mfu"] is None else f"{tp['mfu']:.3f}"
    rows = [
        ("equality", f"{eq['compared']} vs block mask: loss rel {eq['loss_rel_diff']:.2e}, grad rel "
                     f"{eq['grad_rel_diff']:.2e}, cosine {eq['grad_cosine']:.6f} -> {'ok' if eq['ok'] else 'FAIL'}"),
        ("throughput", f"seq {tp['seq_length']}: {tp['tokens_per_s']:.0f} tokens/s, {tp['tflops_per_gpu']:.2f} "
                       f"TFLOPs/GPU, MFU {mfu}, step {tp['step_ms']:.0f} ms, loss {tp['loss_first_last'][0]:.3f}"
                       f" -> {tp['loss_first_last'][1]:.3f}"),
        ("resume", f"iterations {rs['iterations']}, max rel loss diff {rs['max_rel_loss_diff']:.2e}, same data "
                   f"{rs['same_data']} -> {'ok' if rs['ok'] else 'FAIL'}"),
        ("cp2", _cp_row(r["context_parallel"])),
        ("wall", f"{r['wall_s']:.0f} s{' (dry run on CPU)' if r['dry_run'] else ''}"),
    ]  # fmt: skip
    for name, text in rows:
        print(f"{name:<11} {text}")


def _cp_row(cp: dict[str, Any]) -> str:
    if "skipped" in cp:
        return f"skipped: {cp['skipped']}"
    return (
        f"CP 2 ({cp['attention']}) vs CP 1: loss rel {cp['max_rel_loss_diff']:.2e}, grad norm rel "
        f"{cp['max_rel_grad_norm_diff']:.2e} -> {'ok' if cp['ok'] else 'FAIL'}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="everything but CUDA: CPU, fp32, tiny sizes")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_check.json")
    p.add_argument("--equality-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.equality_worker:
        equality_worker(args.dry_run)
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run to run the same checks on CPU", file=sys.stderr)
        return 2
    results = run(args.dry_run, args.out)
    print_table(results)
    ok = results["equality"]["ok"] and results["resume"]["ok"] and results["context_parallel"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
