"""What a run reports beyond its log line, as Megatron-LM users expect: TensorBoard (``--tensorboard-dir``),
Weights & Biases in offline mode (``--wandb-project``), megatron-core's timers (``--log-timers-to-tensorboard``),
the parameter norm (``--log-params-norm``), the zeros in the gradient (``--log-num-zeros-in-grad``), model
TFLOPs and MFU per iteration, memory, and the data wait as the maximum over all ranks.

FLOPs of one step (model FLOPs: what the model needs, whatever recomputation the run adds) are 3 x the
forward FLOPs (the backward pass costs twice the forward). The forward FLOPs of a micro-batch are its model
family's FLOP count (``ModelFamily.flop_model``, the formula of ``mmpack.packing.cost``: language model per
token and per sample's causal attention, vision tower per patch and per image's attention, mergers) over the
micro-batch's features (samples, image and video grids): the same count ``--balance compute`` evens out.

MFU = achieved model TFLOPs per GPU / the GPU's peak dense bf16 TFLOPs (``--peak-tflops-per-gpu``, else a
table of known devices; not reported on CPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import resource
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mmpack.packing.batch import MicroBatch
from mmpack.packing.cost import CostModel, add_video_features, bin_cost_features
from mmpack.trainer.flags import flag

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


@dataclass(kw_only=True, frozen=True)
class ObservabilityConfig:
    """Where metrics go and which optional ones are computed."""

    tensorboard_dir: str | None = flag(None, help="write TensorBoard event files here (last rank)")
    wandb_project: str | None = flag(None, help="log to Weights & Biases (offline mode; needs wandb)")
    wandb_exp_name: str | None = flag(None, help="W&B run name")
    wandb_save_dir: str | None = flag(None, help="W&B offline folder (default: --tensorboard-dir)")
    log_timers_to_tensorboard: bool = flag(
        False, help="megatron-core timers (max over ranks); needs --tensorboard-dir or --wandb-project"
    )
    log_params_norm: bool = flag(False, help="log the L2 norm of all parameters")
    log_num_zeros_in_grad: bool = flag(False, help="log the zeros in the gradient")
    peak_tflops_per_gpu: float | None = flag(None, help="for MFU (default: known GPUs' dense bf16 peak)")

    def __post_init__(self) -> None:
        if self.log_timers_to_tensorboard and not (self.tensorboard_dir or self.wandb_project):
            raise ValueError("--log-timers-to-tensorboard needs --tensorboard-dir or --wandb-project")
        if self.peak_tflops_per_gpu is not None and self.peak_tflops_per_gpu <= 0:
            raise ValueError("--peak-tflops-per-gpu must be > 0")


def sample_lengths(batch: MicroBatch[torch.Tensor], pad_id: int) -> np.ndarray:
    """Lengths of the samples of a micro-batch: the ``cu_seqlens`` segments, less the padding segments."""
    cu = batch.cu_seqlens.detach().cpu().numpy().astype(np.int64)
    starts = batch.tokens.detach().reshape(-1).cpu().numpy()[cu[:-1]]
    lengths = np.diff(cu)
    return lengths[starts != pad_id]


def _grids(grid: torch.Tensor) -> np.ndarray:
    return grid.detach().cpu().numpy().astype(np.int64).reshape(-1, 3)


def micro_batch_features(batch: MicroBatch[torch.Tensor], pad_id: int) -> np.ndarray:
    """The cost features (``mmpack.packing.cost.COST_FEATURES``) of a micro-batch: its samples, images and
    videos (each temporal patch of a video attends alone, as an image)."""
    features = bin_cost_features(sample_lengths(batch, pad_id), _grids(batch.image_grid_thw))
    videos = _grids(batch.video_grid_thw)
    return add_video_features(features[None], videos, np.array([0, len(videos)]))[0]


def step_flops(flop_model: CostModel, batches: list[MicroBatch[torch.Tensor]], pad_id: int) -> float:
    """Model FLOPs (forward + backward = 3x the forward ``flop_model``) of one DP rank's micro-batches."""
    return 3.0 * sum(float(flop_model.cost(micro_batch_features(b, pad_id))) for b in batches)


def peak_tflops(cfg: ObservabilityConfig) -> float | None:
    """The peak dense bf16 TFLOPs of this GPU (flag, else the table), None when unknown or on CPU."""
    if cfg.peak_tflops_per_gpu:
        return cfg.peak_tflops_per_gpu
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


@torch.no_grad()
def params_norm(model: torch.nn.Module) -> float:
    """L2 norm of all parameters of the model (every TP shard and stage once). Collective over the
    model-parallel group."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    first = ps.is_pipeline_first_stage()
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        replicated = not getattr(p, "tensor_model_parallel", False)
        if replicated and tp_rank != 0:
            continue
        if getattr(p, "shared_embedding", False) and not first:
            continue  # the tied output layer is the first stage's embedding
        total += p.detach().double().pow(2).sum().cpu()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = total.to(device)
    dist.all_reduce(total, group=ps.get_model_parallel_group())
    return math.sqrt(float(total))


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise maximum over every rank of the world. Collective."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def memory_gb() -> dict[str, float]:
    """Accelerator memory (allocated now, peak) or, on CPU, the process's peak resident set."""
    if torch.cuda.is_available():
        return {
            "mem_allocated_gb": torch.cuda.memory_allocated() / 2**30,
            "mem_max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        }
    return {"mem_max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


# metric key -> TensorBoard tag (Megatron-LM's names where it has one)
TAGS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "loss_scale": "loss-scale",
    "tokens_per_s": "tokens-per-second",
    "tflops_per_gpu": "throughput/tflops-per-gpu",
    "mfu": "throughput/mfu",
    "data_wait_ms": "data-wait-ms",
    "step_ms": "iteration-time-ms",
    "compute_ms_max": "dp-compute-ms/max",
    "compute_ms_mean": "dp-compute-ms/mean",
    "dp_imbalance": "dp-compute-ms/max-over-mean",
    "params_norm": "params-norm",
    "num_zeros": "num-zeros",
    "real_token_fraction": "real-token-fraction",
    "mem_allocated_gb": "memory/allocated-gb",
    "mem_max_allocated_gb": "memory/max-allocated-gb",
    "mem_max_rss_gb": "memory/max-rss-gb",
    "moe_load_balancing_loss": "load_balancing_loss",  # megatron-core's tag
    "bad_samples": "data/bad-samples",
}


def source_loss_parts(
    token_loss: torch.Tensor, loss_mask: torch.Tensor, token_sources: torch.Tensor, num_sources: int
) -> torch.Tensor:
    """float64 [3, K]: each source's weighted token-loss sum, weight sum and target tokens in one micro-batch,
    from the per-token loss and the loss mask holding each target token's weight (1 under --loss-reduction
    token; flattened B * L, maybe padded past it for THD) and each token's source (`source_ids` [B] repeated
    L times)."""
    flat_loss, flat_mask = token_loss.detach().float().reshape(-1), loss_mask.detach().float().reshape(-1)
    per_token = token_sources.to(flat_loss.device).long().reshape(-1)
    if per_token.numel() < flat_loss.numel():  # THD's padding tail: no targets, counted as source 0
        per_token = torch.cat([per_token, per_token.new_zeros(flat_loss.numel() - per_token.numel())])
    out = torch.zeros((3, num_sources), dtype=torch.float64, device=flat_loss.device)
    out[0].index_add_(0, per_token, (flat_loss * flat_mask).double())
    out[1].index_add_(0, per_token, flat_mask.double())
    out[2].index_add_(0, per_token, (flat_mask != 0).double())
    return out


class SourceMetrics:
    """Per-source loss (under the run's --loss-reduction) and target tokens of a mixture, summed over the
    steps of one logging interval."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.totals = np.zeros((3, len(names)))

    def add(self, sums: list[float]) -> None:
        """One step's [weighted loss sums..., weight sums..., token counts...] over every DP rank."""
        self.totals += np.asarray(sums, dtype=np.float64).reshape(3, len(self.names))

    def take(self) -> dict[str, Any]:
        """The interval's `source_loss` and `source_tokens` by name; starts the next interval."""
        loss, weight, tokens = self.totals
        out = {
            "source_loss": {n: float(s / w) if w else None for n, s, w in zip(self.names, loss, weight)},
            "source_tokens": {n: int(t) for n, t in zip(self.names, tokens)},
        }
        self.totals = np.zeros_like(self.totals)
        return out


def source_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """TensorBoard tags of the per-source metrics: `lm loss/<source>`, `tokens/<source>`."""
    out = {f"lm loss/{n}": v for n, v in (metrics.get("source_loss") or {}).items() if v is not None}
    return out | {f"tokens/{n}": float(v) for n, v in (metrics.get("source_tokens") or {}).items()}


def bad_samples_folder(save: str | None, tensorboard_dir: str | None, metrics_file: str | None) -> str | None:
    """Where each rank lists the samples its loader dropped: --save, else --tensorboard-dir, else the folder of
    --metrics-file; None: nowhere (the log's warning lines name them)."""
    if save or tensorboard_dir:
        return save or tensorboard_dir
    return os.path.dirname(os.path.abspath(metrics_file)) if metrics_file else None


class BadSamples:
    """The samples the loader dropped from their bins because their media could not be decoded
    (`MicroBatch.dropped`: labels masked, media blank). The rank that read them writes one warning line and one
    JSON line each (`<folder>/bad_samples-rank<R>.jsonl`: sample id, dataset, bin, medium, error, iteration,
    phase); the log line and the metrics count them over every rank."""

    LOGGED = 100  # warning lines per rank: a dataset with many bad samples does not flood the log

    def __init__(self, folder: str | None, *, rank: int) -> None:
        self.rank = rank
        self.path = None if folder is None else os.path.join(folder, f"bad_samples-rank{rank}.jsonl")
        self.mine = 0  # samples dropped from the batches this rank read

    def note(
        self,
        batches: list[MicroBatch[torch.Tensor]],
        *,
        iteration: int,
        phase: str,
        datasets: tuple[str, ...],
    ) -> None:
        """Records the samples the micro-batches of one step dropped (on the rank that read them);
        `datasets`: the name of each `source_ids` value."""
        rows = []
        for batch in batches:
            for d in batch.dropped:
                source = 0 if batch.source_ids is None else int(batch.source_ids[d.row])
                rows.append({
                    "sample_id": d.sample_id,
                    "dataset": datasets[source] if source < len(datasets) else str(source),
                    "bin": d.bin_key,
                    "media": d.media,
                    "error": d.error,
                    "iteration": iteration,
                    "phase": phase,
                })  # fmt: skip
        if not rows:
            return
        where = f"; listed in {self.path}" if self.path else ""
        for r in rows:
            self.mine += 1
            if self.mine > self.LOGGED:
                continue
            more = (
                f" (the first {self.LOGGED} are logged; the count goes on)"
                if self.mine == self.LOGGED
                else ""
            )
            print(
                f"mmpack trainer: warning: rank {self.rank}: dropped sample {r['sample_id']!r} of {r['dataset']} "
                f"(bin {r['bin']}, {phase} iteration {iteration}): {r['media']} cannot be decoded: {r['error']}"
                f"{where}{more}",
                file=sys.stderr,
                flush=True,
            )
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))

    def count(self) -> int:
        """The samples dropped so far, over every rank. Collective."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        total = torch.tensor([float(self.mine)], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        return int(total.item())


class RouterLosses:
    """The MoE routers' load-balancing loss of each step, as megatron-core's routers record it in its
    layer-wise tracker: the mean over the MoE layers, and each layer's with ``--moe-per-layer-logging``.
    The values are the loss before ``--moe-aux-loss-coeff`` scales it, summed over the TP x CP ranks that share
    the tokens, averaged over DP ranks and over the step's micro-batches (as Megatron-LM logs them)."""

    NAME = "load_balancing_loss"

    def __init__(self, language_config: Any, *, per_layer: bool) -> None:
        self.num_layers = int(language_config.num_layers)
        self.per_layer = per_layer

    @staticmethod
    def wanted(language_config: Any) -> bool:
        """An MoE language model whose routers add the load-balancing loss (a coefficient above 0)."""
        coeff = getattr(language_config, "moe_aux_loss_coeff", 0) or 0
        coeffs = coeff if isinstance(coeff, list) else [coeff]
        return bool(getattr(language_config, "num_moe_experts", None)) and any(c > 0 for c in coeffs)

    def start(self) -> None:
        """Before a step's forward passes (drops what evaluation passes recorded)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()

    def take(self, num_microbatches: int) -> dict[str, Any]:
        """The step's losses, reduced over the ranks (collective: every rank calls it), then cleared."""
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
            reduce_aux_losses_tracker_across_ranks,
        )

        tracker = get_moe_layer_wise_logging_tracker()
        if self.NAME not in tracker:  # a stage without MoE layers still takes part in the reductions
            device = "cuda" if torch.cuda.is_available() else "cpu"
            tracker[self.NAME] = {
                "values": torch.zeros(self.num_layers, device=device),
                "reduce_group": ps.get_tensor_and_context_parallel_group(),
                "avg_group": None,
                "reduce_group_has_dp": False,
            }
        reduce_aux_losses_tracker_across_ranks([self.NAME])
        values = tracker[self.NAME]["values"].float().cpu() / max(num_microbatches, 1)
        out: dict[str, Any] = {"moe_load_balancing_loss": float(values.sum()) / self.num_layers}
        if self.per_layer:
            out["moe_load_balancing_loss_layers"] = values.tolist()
        clear_aux_losses_tracker()
        return out


def router_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """TensorBoard tags of each layer's load-balancing loss (`moe/load_balancing_loss_layer_<i>`, Megatron-LM's)."""
    layers = metrics.get("moe_load_balancing_loss_layers") or []
    return {f"moe/{RouterLosses.NAME}_layer_{i}": float(v) for i, v in enumerate(layers)}


class MetricsSink:
    """TensorBoard and W&B writers of the logging rank (the last one, as in Megatron-LM); no-ops elsewhere."""

    def __init__(self, cfg: ObservabilityConfig, *, is_logger: bool, run_config: dict[str, Any]) -> None:
        self.cfg = cfg
        self.tensorboard: Any = None
        self.wandb: Any = None
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise ValueError(
                    "--wandb-project needs the wandb package (pip install wandb); or log to --tensorboard-dir"
                ) from e
            if is_logger:
                self.wandb = wandb.init(
                    project=cfg.wandb_project, name=cfg.wandb_exp_name, dir=cfg.wandb_save_dir or cfg.tensorboard_dir,
                    mode="offline", config=run_config,
                )  # fmt: skip
        if cfg.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:  # every rank stops
            raise ValueError(
                '--tensorboard-dir needs the tensorboard package: pip install -e ".[test]" (or pip install '
                "tensorboard)"
            )
        if cfg.tensorboard_dir and is_logger:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=1000)

    @property
    def timer_writer(self) -> Any:
        """What megatron-core's ``Timers.write`` takes (a SummaryWriter; None on other ranks)."""
        return self.tensorboard

    def write(self, iteration: int, metrics: dict[str, Any]) -> None:
        scalars = {
            TAGS[k]: float(v)
            for k, v in metrics.items()
            if k in TAGS and v is not None and math.isfinite(float(v))
        } | {k: v for k, v in (source_scalars(metrics) | router_scalars(metrics)).items() if math.isfinite(v)}
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, iteration)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


TIMER_NAMES = [
    "forward-backward", "forward-compute", "backward-compute", "forward-recv", "forward-send",
    "backward-recv", "backward-send", "forward-send-backward-recv", "backward-send-forward-recv",
    "all-grads-sync", "optimizer-copy-to-main-grad", "optimizer-clip-main-grad", "optimizer-count-zeros",
    "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
]  # fmt: skip


class Observer:
    """The metrics of each step beyond loss and learning rate, and where they are written."""

    def __init__(
        self, cfg: ObservabilityConfig, *, flop_model: CostModel, pad_id: int, model: Any, optimizer: Any,
        language_config: Any, is_logger: bool, run_config: dict[str, Any],
    ) -> None:  # fmt: skip
        from megatron.core.timers import Timers

        self.cfg, self.flop_model, self.pad_id, self.model = cfg, flop_model, pad_id, model
        self.sink = MetricsSink(cfg, is_logger=is_logger, run_config=run_config)
        self.peak = peak_tflops(cfg)
        self.timers = Timers(2, "max") if cfg.log_timers_to_tensorboard else None
        if self.timers is not None:  # megatron-core's schedule, grad sync and optimizer time themselves
            language_config.timers = self.timers
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                opt.config.timers = self.timers

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Times the block with megatron-core's timer ``name`` (when timers are on)."""
        if self.timers is None:
            yield
            return
        self.timers(name, log_level=1).start()
        try:
            yield
        finally:
            self.timers(name).stop()

    def step_metrics(
        self, batches: list[MicroBatch[torch.Tensor]], *, wait_s: float, elapsed_s: float, num_zeros: Any
    ) -> dict[str, Any]:
        """TFLOPs, MFU, the slowest rank's data wait and step time, norms, memory. Collective."""
        flops = torch.tensor([step_flops(self.flop_model, batches, self.pad_id)], dtype=torch.float64)
        flops = flops.to("cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(flops, group=ps.get_data_parallel_group())
        wait_max, step_max = max_over_ranks([wait_s, elapsed_s])
        tflops = float(flops) / max(step_max, 1e-9) / dist.get_world_size() / 1e12
        out: dict[str, Any] = {
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "data_wait_ms": wait_max * 1e3,
            "step_ms": step_max * 1e3,
            **memory_gb(),
        }
        if self.cfg.log_params_norm:
            out["params_norm"] = params_norm(self.model)
        if self.cfg.log_num_zeros_in_grad and num_zeros is not None:
            out["num_zeros"] = float(num_zeros)
        return out

    def write(self, metrics: dict[str, Any]) -> None:
        """To TensorBoard / W&B (logging rank)."""
        self.sink.write(int(metrics["iteration"]), metrics)

    def write_timers(self, iteration: int, normalizer: float) -> None:
        """megatron-core's timers (max over ranks) to TensorBoard. Collective."""
        if self.timers is not None:
            self.timers.write(TIMER_NAMES, self.sink.timer_writer, iteration, normalizer=normalizer)

    def close(self) -> None:
        self.sink.close()
