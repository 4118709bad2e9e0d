"""Setting up megatron-core (process groups, model, optimizer, schedule) and the training loop."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import random
import sys
import time
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mmpack.dataloader import load_manifest
from mmpack.packing.batch import MicroBatch
from mmpack.packing.cost import CostModel
from mmpack.trainer.build import (
    build_model,
    check_data_matches_model,
    check_dataset_for_hf_model,
    model_hf_config,
    run_lora_spec,
)
from mmpack.trainer.checkpoint import CheckpointWriter, load_checkpoint
from mmpack.trainer.checkpoint_commit import HF_CONFIG_NAME, claim_checkpoint_folder
from mmpack.trainer.config import RunConfig, build_megatron_configs
from mmpack.trainer.context_parallel import CpRank, cp_micro_batch
from mmpack.trainer.cpu_backend import require_backend
from mmpack.trainer.data import (
    DataInfo,
    build_step_batches,
    dataset_info,
    model_inputs,
    open_raw_data,
    packed_sources,
    pad_flat_batch,
    raw_sources,
    thd_length,
)
from mmpack.trainer.exits import ExitPolicy, ExitSignals
from mmpack.trainer.freeze import count_parameters
from mmpack.trainer.lora.export import write_run_config
from mmpack.trainer.loss_reduction import weigh_step
from mmpack.trainer.models import family_of
from mmpack.trainer.models.protocol import ModelArch, ModelFamily
from mmpack.trainer.observability import (
    BadSamples,
    Observer,
    RouterLosses,
    SourceMetrics,
    bad_samples_folder,
    source_loss_parts,
)
from mmpack.trainer.online_rejects import RawRejects
from mmpack.trainer.shared_batches import SharedStepBatches, shared_step_batches
from mmpack.trainer.stage_flags import check_model_flags, check_stage_flags


def balance_cost_model(
    family: ModelFamily[ModelArch], arch: ModelArch, *, use_te: bool, given: tuple[float, ...] | None = None,
    cp_size: int = 1,
) -> CostModel:  # fmt: skip
    """The bin cost `--balance compute` evens out over DP ranks: `given` coefficients (`--balance-cost`), else
    the FLOP count of the model being trained (its family's `flop_model`, the count MFU reports); under
    context parallelism the work of one CP rank (`CostModel.per_cp_rank`: 1/CP of the language model, the
    whole vision tower).

    Without Transformer Engine the language model attends through a dense [seq, seq] block mask, whose work
    is the same for every bin, so only with TE (attention per sample, THD) does the sum of squared sample
    lengths count."""
    if given is not None:
        return CostModel.from_coefficients(given).per_cp_rank(cp_size)
    return family.flop_model(arch, attention_by_sample=use_te).per_cp_rank(cp_size)


def te_available() -> bool:
    """Transformer Engine on a CUDA machine: then attention takes THD packed sequences (cu_seqlens)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def initialize_distributed(cfg: RunConfig, *, virtual_pipeline_size: int | None = None) -> bool:
    """Process group (gloo on CPU, NCCL on CUDA), megatron-core parallel state (with the model chunks per
    stage of an interleaved pipeline) and seeds. Returns on_cpu. Without CUDA the entry point has set up the
    CPU backend (`cpu_backend.activate`)."""
    on_cpu = require_backend("initialize_distributed")
    par = cfg.parallel
    if not dist.is_initialized():
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(minutes=par.distributed_timeout_minutes)
        dist.init_process_group(
            process_group_backend(par.distributed_backend, on_cpu=on_cpu), timeout=timeout
        )
    par.data_parallel_size(dist.get_world_size())  # validates the layout divides the world
    ps.initialize_model_parallel(
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size,
        context_parallel_size=par.context_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.expert_tensor_parallel_size,
        distributed_timeout_minutes=par.distributed_timeout_minutes,  # type: ignore[arg-type]
    )
    seed = cfg.train.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return on_cpu


def process_group_backend(given: str | None, *, on_cpu: bool) -> str:
    """gloo on CPU, NCCL on CUDA; ``--distributed-backend nccl`` without CUDA falls back to gloo with one
    warning line (rank 0), gloo on CUDA is refused."""
    if on_cpu:
        if given == "nccl" and os.environ.get("RANK", "0") == "0":
            print("pretrain_vlm: warning: --distributed-backend nccl: no CUDA here, running gloo on CPU", file=sys.stderr, flush=True)  # fmt: skip
        return "gloo"
    if given == "gloo":
        raise ValueError(
            "--distributed-backend gloo: on CUDA mmpack runs NCCL; leave the flag out or give nccl"
        )
    return "nccl"


def resolve_train_config(cfg: RunConfig, info: DataInfo, dp_size: int) -> RunConfig:
    """Fill in what comes from the dataset (sequence length) and the default global batch (one
    micro-batch per DP rank)."""
    global_batch = cfg.train.global_batch_size or cfg.train.micro_batch_size * dp_size
    train = dataclasses.replace(cfg.train, seq_length=info.seq_length, global_batch_size=global_batch)
    return dataclasses.replace(cfg, train=train)


def microbatches_per_step(cfg: RunConfig, dp_size: int, virtual_pipeline_size: int | None) -> int:
    """Micro-batches per step and DP rank; the interleaved schedule runs them in groups of PP, so there it
    must be a multiple of PP (megatron-core otherwise stops mid-schedule)."""
    num_micro = cfg.train.num_microbatches(dp_size)
    pp = cfg.parallel.pipeline_model_parallel_size
    if virtual_pipeline_size and num_micro % pp:
        raise ValueError(
            f"the interleaved pipeline runs micro-batches in groups of PP = {pp}: --global-batch-size "
            f"{cfg.train.global_batch_size} / (--micro-batch-size {cfg.train.micro_batch_size} x DP "
            f"{dp_size}) = {num_micro} micro-batches per step is not a multiple of {pp}"
        )
    return num_micro


def build_scheduler(cfg: RunConfig, optimizer: Any) -> OptimizerParamScheduler:
    """Linear warmup from 0 to --lr, then decay to --min-lr, counted in iterations."""
    o = cfg.optim
    decay_iters = o.lr_decay_iters or cfg.train.train_iters
    # Megatron-LM's --lr-warmup-fraction: that fraction of the decay iterations (not rounded)
    warmup = o.lr_warmup_iters if o.lr_warmup_fraction is None else o.lr_warmup_fraction * decay_iters
    decay = max(decay_iters, math.floor(warmup) + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=warmup,  # type: ignore[arg-type]
        lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )


def _loss_func(loss_mask: torch.Tensor, poison: bool, sources: Any, scale: float, output: torch.Tensor):
    """megatron-core's per-token loss (``calculate_per_token_loss``): the micro-batch's summed token loss and
    its number of target tokens; the schedule sums both over micro-batches, ``finalize_model_grads`` over DP
    ranks, and divides the gradients by the step's token count, so every target token of the global batch
    weighs the same whatever micro-batch it is in. Under ``--loss-reduction`` sample / square, ``loss_mask``
    holds each target token's weight times ``scale`` (``loss_reduction.weigh_step``), 0 elsewhere. The pair is
    also what gets logged; `sources` (a mixture: the rows' source ids and the number of sources) adds each
    source's sums (with the unscaled weights)."""
    loss_sum = (output.float().reshape(-1) * loss_mask.reshape(-1)).sum()
    if poison:
        loss_sum = loss_sum * math.inf
    num_tokens = (loss_mask != 0).sum().to(torch.int)
    reported = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}
    if sources is not None:
        weights = loss_mask / scale if scale not in (0.0, 1.0) else loss_mask  # 0: no target in the step
        reported["source loss"] = source_loss_parts(output, weights, *sources)
    return loss_sum, num_tokens, reported


def _tokens_digest(tokens: torch.Tensor) -> int:
    """A position-weighted checksum of a micro-batch's tokens: shows which data a step consumed."""
    weights = torch.arange(1, tokens.numel() + 1, dtype=torch.int64, device=tokens.device)
    return int((tokens.reshape(-1).long() * weights).sum()) % 1_000_000_007


class Trainer:
    """Owns model, optimizer, scheduler and data of one rank and runs steps."""

    def __init__(self, cfg: RunConfig, *, exit_signals: ExitSignals | None = None) -> None:
        """``exit_signals``: the SIGTERM / SIGUSR1 recorder of ``--exit-signal-handler``, installed by the
        caller before anything forks."""
        self.exit_policy = ExitPolicy(cfg.exit, exit_signals, start_s=time.time())
        # --online-packing: the raw records of --data-path, packed by the loader as it goes
        self.raw_data = open_raw_data(cfg) if cfg.data.online_packing else None
        train_data = self.raw_data or cfg.data.train_data
        info = dataset_info(train_data, cfg.train.seq_length)
        self.hf_config = model_hf_config(cfg, info)
        self.family = family_of(self.hf_config)
        self.arch = self.family.arch_from_hf_config(self.hf_config)
        if not train_data:  # --mock-data: pixels as this model's patches take them
            info = dataclasses.replace(info, temporal_patch_size=self.arch.vision.temporal_patch_size)
        self.virtual_pipeline_size = cfg.parallel.virtual_pipeline_size(self.arch.num_layers)
        self.on_cpu = initialize_distributed(cfg, virtual_pipeline_size=self.virtual_pipeline_size)
        if cfg.checkpoint.save:  # refused before any work when it is not mmpack's to write into
            claim_checkpoint_folder(cfg.checkpoint.save, role="checkpoint folder (--save)")
        self.dp_size = ps.get_data_parallel_world_size()
        self.cfg = cfg = resolve_train_config(cfg, info, self.dp_size)
        check_data_matches_model(
            self.family, self.arch, info, cfg.model.hf_model or "(random, from the size flags)"
        )
        # tokenizer file and the image rule of every source (a raw source is counted by the folder's own)
        if cfg.model.hf_model and (packed := packed_sources(cfg.data.train_data)):
            check_dataset_for_hf_model(packed, cfg.model.hf_model)
        self._check_stage_flags(cfg, info)
        self.use_te = te_available()
        self.pad_id = info.pad_id
        self.thd_multiple = cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1
        self.cp: CpRank | None = None
        if cfg.parallel.context_parallel_size > 1:
            self.cp = CpRank(
                cp_size=ps.get_context_parallel_world_size(),
                cp_rank=ps.get_context_parallel_rank(),
                pad_id=info.pad_id,
                image_pad_id=self.arch.image_token_id,
                video_pad_id=self.arch.video_token_id,
            )
        self.mcfg = build_megatron_configs(
            cfg, self.arch, use_te=self.use_te, pipeline_rank=ps.get_pipeline_model_parallel_rank()
        )
        self.num_micro = microbatches_per_step(cfg, self.dp_size, self.virtual_pipeline_size)
        self.chunks = build_model(cfg, self.mcfg, self.arch, use_te=self.use_te)
        self.trainable_message = self._count_trainable()
        self.optimizer = get_megatron_optimizer(self.mcfg.optimizer, self.chunks)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        lang = self.mcfg.language
        lang.grad_scale_func = self.optimizer.scale_loss
        lang.finalize_model_grads_func = self._finalize_grads
        self._grads_ready_at: float | None = None
        lang.no_sync_func = self._per_chunk(lambda c: c.no_sync)
        if cfg.parallel.overlap_grad_reduce:  # the schedule starts each bucket's reduction when it is ready
            lang.grad_sync_func = self._per_chunk(lambda c: c.start_grad_sync)
        if cfg.parallel.overlap_param_gather:  # and the next forward waits for its bucket's parameters
            lang.param_sync_func = self._per_chunk(lambda c: c.start_param_sync)
        step_batches = partial(
            build_step_batches,
            info=info,
            micro_batch_size=cfg.train.micro_batch_size,
            global_batch_size=cfg.train.global_batch_size,
            num_workers=cfg.data.num_workers,
            cache_dir=cfg.data.cache_dir,
            balance=cfg.data.balance,
            cost_model=balance_cost_model(
                self.family,
                self.arch,
                use_te=self.use_te,
                given=cfg.data.balance_cost,
                cp_size=cfg.parallel.context_parallel_size,
            )
            if cfg.data.balance == "compute"
            else None,
            position_rule=self.family.position_rule(self.arch),
            strict_data=cfg.data.strict_data,
        )
        split = cfg.data.split
        carves = split is not None and (
            split[1] > 0 or split[2] > 0
        )  # 100,0,0 trains on every bin, as without
        folder = bad_samples_folder(cfg.checkpoint.save, cfg.logging.tensorboard_dir, cfg.train.metrics_file)
        self.raw_rejects = RawRejects(folder) if self.raw_data is not None else None
        self.train_data = shared_step_batches(
            partial(
                step_batches,
                train_data,
                seed=cfg.train.seed,
                split=(split, 0, cfg.train.seed) if carves else None,
                rejects_dir=folder if self.raw_data is not None else None,
            )
        )
        self.eval_data: SharedStepBatches | None = None
        if cfg.train.eval_interval > 0:
            eval_path = cfg.data.eval_data_path or (train_data if split else None)
            if train_data and not eval_path:
                raise ValueError(
                    "--eval-interval needs held-out data: --eval-data-path (a packed dataset) or --split "
                    "(e.g. 969,30,1: a valid part of --data-path's bins)"
                )
            self.eval_data = shared_step_batches(
                partial(
                    step_batches,
                    eval_path,
                    seed=cfg.train.seed + 1,
                    split=split and (split, 1, cfg.train.seed),
                )
            )
        self.iteration = 0
        self.skipped = 0
        names = cfg.data.source_names
        if names and self.cp is not None:  # each CP rank holds a share of every row: no per-row source sums
            if dist.get_rank() == 0:
                print(
                    "mmpack trainer: note: under --context-parallel-size > 1 a mixture logs its blended loss only"
                )
            names = ()
        self.source_metrics = SourceMetrics(names) if names else None
        self.router_losses = (
            RouterLosses(self.mcfg.language, per_layer=cfg.stage.moe_per_layer_logging)
            if RouterLosses.wanted(self.mcfg.language)
            else None
        )
        if cfg.stage.moe_per_layer_logging and self.router_losses is None and dist.get_rank() == 0:
            print(
                "pretrain_vlm: note: --moe-per-layer-logging: the model's routers add no load-balancing loss "
                "(a dense model, or --moe-aux-loss-coeff 0): nothing to log",
                file=sys.stderr,
                flush=True,
            )
        self.is_logger = dist.get_rank() == dist.get_world_size() - 1
        self.bad_samples = BadSamples(folder, rank=dist.get_rank())
        self.observer = Observer(
            cfg.logging, flop_model=self.family.flop_model(self.arch), pad_id=info.pad_id,
            model=torch.nn.ModuleList(self.chunks),
            optimizer=self.optimizer,
            language_config=self.mcfg.language, is_logger=self.is_logger, run_config=dataclasses.asdict(cfg),
        )  # fmt: skip
        ck = cfg.checkpoint
        self.writer = CheckpointWriter(ck.save, async_save=ck.async_save) if ck.save else None
        self.saved_iteration: int | None = None  # the iteration --save holds already
        if ck.load:
            self.iteration, loader_state, message = load_checkpoint(
                ck.load, self.chunks, self.optimizer, self.scheduler, self.hf_config,
                load_optim=not ck.no_load_optim, finetune=ck.finetune, verify=not ck.no_verify_checkpoint,
            )  # fmt: skip
            if loader_state is not None:
                self.train_data.load_state_dict(loader_state)
            if ck.save and _same_folder(ck.load, ck.save):  # nothing new to save before the next step
                self.saved_iteration = self.iteration
            self.log_text(message)

    def _check_stage_flags(self, cfg: RunConfig, info: DataInfo) -> None:
        """The Megatron-LM stage-script flags fixed by the dataset and the model (trainer/stage_flags.py)."""
        flags = cfg.stage
        source = cfg.model.hf_model or cfg.checkpoint.load or f"--model-type {cfg.model.model_type}"
        check_model_flags(flags, self.arch, seq_length=info.seq_length, source=source)

        d = cfg.data  # one dataset, or every source of a mixture
        mixed = d.data_mixture.sources if d.data_mixture else ()
        paths = [(s.path, s.storage_options) for s in mixed if s.kind != "raw"]
        paths += [(d.data_path, None)] if d.data_path else []
        for path, options in paths:
            check_stage_flags(flags, load_manifest(path, storage_options=options).raw, data_path=path)
        for raw in raw_sources(self.raw_data):  # the rules its records are packed by
            check_stage_flags(flags, raw.dataset.to_dict(), data_path=raw.name)
        if dist.get_rank() == 0:
            for note in flags.notes(on_cpu=self.on_cpu, balance=cfg.data.balance):
                print(f"pretrain_vlm: note: {note}", file=sys.stderr, flush=True)

    @property
    def model(self) -> Any:
        """The DDP-wrapped model of this stage (a run without the interleaved pipeline has one chunk)."""
        if len(self.chunks) != 1:
            raise AttributeError(f"this stage holds {len(self.chunks)} model chunks: use Trainer.chunks")
        return self.chunks[0]

    def _per_chunk(self, get: Any) -> Any:
        """``get(chunk)`` of the one chunk, or the list over the chunks (megatron-core's schedules take both)."""
        found = [get(c) for c in self.chunks]
        return found[0] if len(found) == 1 else found

    def _count_trainable(self) -> str:
        """The log line saying how many parameters train (over all TP x PP ranks); ValueError if none."""
        device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces CUDA tensors only
        local = count_parameters(torch.nn.ModuleList(self.chunks))
        counts = torch.tensor([*local, float(local[0] == 0)], dtype=torch.float64, device=device)
        dist.all_reduce(counts, group=ps.get_model_parallel_group())
        trainable, total, idle_ranks = (int(x) for x in counts.tolist())
        m = self.cfg.model
        flags = (
            (["--freeze-vision"] if m.freeze_vision else [])
            + (["--freeze-llm"] if m.freeze_llm else [])
            + ([f"--trainable-modules {','.join(m.trainable_modules)}"] if m.trainable_modules else [])
        )
        if trainable == 0:
            raise ValueError(f"no parameter trains with {' '.join(flags)}")
        if idle_ranks and self.cfg.parallel.use_distributed_optimizer and self.cfg.checkpoint.save:
            from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

            if not HAVE_APEX_OR_TE:  # its torch-Adam path asserts on an optimizer shard without parameters
                raise ValueError(
                    f"{' '.join(flags)} leaves a TP x PP rank with nothing to train: megatron-core's distributed "
                    "optimizer cannot checkpoint it without Transformer Engine or Apex; drop "
                    "--use-distributed-optimizer (the trainable part is small) or train a module on every stage"
                )
        return f"trainable parameters: {trainable:,} of {total:,} ({100.0 * trainable / total:.2f}%)" + (
            f" with {' '.join(flags)}" if flags else ""
        )

    # -- steps --------------------------------------------------------------------------------------------
    def _forward_step(self, poison: bool, scale: float, data_iterator: Any, model: Any):
        batch: MicroBatch[torch.Tensor] = next(data_iterator)
        if self.cp is not None:  # this CP rank's share of every sample (split on the host)
            inputs, loss_mask = cp_micro_batch(batch, self.cp, use_thd=self.use_te)
            return model(**inputs), partial(_loss_func, loss_mask, poison, None, scale)
        if torch.cuda.is_available():
            batch = batch.map_arrays(lambda v: v.cuda(non_blocking=True))
        sources = None
        if self.source_metrics is not None and batch.source_ids is not None:  # per token, before THD padding
            sources = (
                batch.source_ids.repeat_interleave(batch.tokens.shape[1]),
                len(self.source_metrics.names),
            )
        if self.use_te:  # THD: under sequence parallelism the flattened length must divide by TP
            batch = pad_flat_batch(batch, self.thd_multiple, self.pad_id)
        output = model(**model_inputs(batch, use_thd=self.use_te))
        return output, partial(_loss_func, batch.loss_mask, poison, sources, scale)

    def _run_schedule(
        self, batches: list[MicroBatch[torch.Tensor]], *, forward_only: bool, poison: bool = False
    ):
        b, seq = self.cfg.train.micro_batch_size, self.cfg.train.seq_length
        if self.use_te:
            b, seq = 1, thd_length(b * seq, self.thd_multiple)
        # the token weights of --loss-reduction over the whole global batch, before any CP split
        step = weigh_step(batches, self.cfg.train.loss_reduction, ps.get_data_parallel_group())
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, poison, step.scale),
            # each model chunk runs every micro-batch (the interleaved schedule takes one iterator per chunk)
            data_iterator=self._per_chunk(lambda _: iter(step.batches)),
            model=self.chunks,
            num_microbatches=len(batches),
            seq_length=seq,
            micro_batch_size=b,
            decoder_seq_length=seq,
            forward_only=forward_only,
        )

    def _finalize_grads(self, *args: Any, **kwargs: Any) -> Any:
        """megatron-core's `finalize_model_grads`, noting when this rank's forward and backward passes ended
        (the gradient reduction then waits for the slowest DP rank)."""
        self._grads_ready_at = time.perf_counter()
        return finalize_model_grads(*args, **kwargs)

    def _reduce_over_dp(
        self, values: list[float], op: Any = dist.ReduceOp.SUM, *, with_cp: bool = False
    ) -> list[float]:
        """Sums ``values`` (or reduces them by ``op``) over this stage's DP group (meaningful on the last
        pipeline stage); ``with_cp``: over DP x CP (the loss, whose tokens the CP ranks share)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces CUDA tensors only
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op, group=ps.get_data_parallel_group(with_context_parallel=with_cp))
        return t.tolist()

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over a global batch; returns the metrics of the step."""
        batches, wait_s = self.train_data.next_step()
        if self.train_data.source is not None:  # the rank that read them names the samples its loader dropped
            self.bad_samples.note(
                batches, iteration=self.iteration + 1, phase="train", datasets=self._datasets()
            )
        start = time.perf_counter()
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        poison = (self.iteration + 1) in self.cfg.train.debug_overflow_iterations
        self._grads_ready_at = None
        if self.router_losses is not None:
            self.router_losses.start()
        losses = self._run_schedule(batches, forward_only=False, poison=poison)  # timed by the schedule
        # this rank's compute: its forward and backward passes, up to the gradient reduction over DP ranks
        compute_s = (self._grads_ready_at or time.perf_counter()) - start
        lr = self.optimizer.param_groups[0]["lr"]
        with self.observer.timed("optimizer"):
            ok, grad_norm, num_zeros = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        else:
            self.skipped += 1
        self.iteration += 1
        real = float(sum(int(b.num_real_tokens) for b in batches))
        loss_sum = sum(float(x["lm loss"][0]) for x in losses) if losses else 0.0
        n_tok = sum(float(x["lm loss"][1]) for x in losses) if losses else 0.0
        digest = float(sum(_tokens_digest(b.tokens) for b in batches))
        loss_sum, n_tok = self._reduce_over_dp([loss_sum, n_tok], with_cp=True)
        real, digest, compute_sum = self._reduce_over_dp([real, digest, compute_s])
        (compute_max,) = self._reduce_over_dp([compute_s], op=dist.ReduceOp.MAX)
        if self.source_metrics is not None:
            k = len(self.source_metrics.names)
            parts = (
                sum((x["source loss"].cpu() for x in losses), torch.zeros(3, k, dtype=torch.float64))
                if losses
                else torch.zeros(3, k, dtype=torch.float64)
            )
            self.source_metrics.add(self._reduce_over_dp(parts.reshape(-1).tolist()))
        compute_mean = compute_sum / self.dp_size
        elapsed = time.perf_counter() - start + wait_s
        total = float(self.cfg.train.global_batch_size * self.cfg.train.seq_length)
        extra = self.observer.step_metrics(batches, wait_s=wait_s, elapsed_s=elapsed, num_zeros=num_zeros)
        if self.router_losses is not None:
            extra |= self.router_losses.take(len(batches))
        if self.raw_rejects is not None:  # records of --online-packing the loader skipped so far
            extra |= self.raw_rejects.step_metrics(self.train_data)
        return extra | {
            "iteration": self.iteration,
            "loss": loss_sum / max(n_tok, 1.0),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "loss_scale": float(self.optimizer.get_loss_scale().item()),
            "skipped": not ok,
            "skipped_total": self.skipped,
            "target_tokens": int(n_tok),
            "tokens_per_s": real / elapsed,
            "real_token_fraction": real / total,
            "data_digest": int(digest),
            # the DP ranks' forward + backward time: the slowest, the mean, and their ratio (1.0 = even)
            "compute_ms_max": compute_max * 1e3,
            "compute_ms_mean": compute_mean * 1e3,
            "dp_imbalance": compute_max / max(compute_mean, 1e-12),
            "bins_consumed": int(self.train_data.state_dict().get("bins_consumed", -1)),
            "bad_samples": self.bad_samples.count(),  # dropped so far, over all ranks
        }

    def _datasets(self, *, eval_data: bool = False) -> tuple[str, ...]:
        """The dataset of each `source_ids` value of the training (or eval) batches, as the flags named it."""
        d = self.cfg.data
        if eval_data and d.eval_data_path:
            return (d.eval_data_path,)
        return d.source_names or (str(d.data_path or " ".join(d.raw_inputs)),)

    def evaluate(self) -> float:
        """Mean target-token loss over --eval-iters global batches of the held-out data."""
        assert self.eval_data is not None
        for chunk in self.chunks:
            chunk.eval()
        loss_sum = n_tok = 0.0
        with torch.no_grad():
            for _ in range(self.cfg.train.eval_iters):
                batches, _ = self.eval_data.next_step()
                if self.eval_data.source is not None:
                    names = self._datasets(eval_data=True)
                    self.bad_samples.note(batches, iteration=self.iteration, phase="eval", datasets=names)
                for x in self._run_schedule(batches, forward_only=True):
                    loss_sum += float(x["lm loss"][0])
                    n_tok += float(x["lm loss"][1])
        for chunk in self.chunks:
            chunk.train()
        loss_sum, n_tok = self._reduce_over_dp([loss_sum, n_tok], with_cp=True)
        return loss_sum / max(n_tok, 1.0)

    # -- logging and the loop -----------------------------------------------------------------------------
    def log_text(self, text: str) -> None:
        if self.is_logger:
            print(text, flush=True)

    def log_metrics(self, m: dict[str, Any]) -> None:
        if not self.is_logger:
            return
        gn = "nan" if m.get("grad_norm") is None else f"{m['grad_norm']:.3f}"
        mfu = "" if m.get("mfu") is None else f" MFU: {m['mfu']:.3f} |"
        self.log_text(
            f" iteration {m['iteration']:>6}/{self.cfg.train.train_iters:>6} | lm loss: {m['loss']:.6E} |"
            f" loss reduction: {self.cfg.train.loss_reduction} |"
            f" learning rate: {m['lr']:.3E} | grad norm: {gn} | loss scale: {m['loss_scale']:.1f} |"
            f" tokens/s: {m['tokens_per_s']:.1f} | real-token fraction: {m['real_token_fraction']:.3f} |"
            f" data-wait ms (max over ranks): {m['data_wait_ms']:.1f} | step ms: {m['step_ms']:.1f} |"
            f" DP compute max/mean: {m['dp_imbalance']:.3f} |"
            f" TFLOPs/GPU: {m['tflops_per_gpu']:.3f} |{mfu}"
            f" skipped iterations: {m['skipped_total']} |"
            + ("" if not m.get("bad_samples") else f" bad samples: {m['bad_samples']} |")
            + ("" if not m.get("raw_rejected") else f" rejected records: {m['raw_rejected']} |")
            + (
                ""
                if m.get("moe_load_balancing_loss") is None
                else f" load-balancing loss: {m['moe_load_balancing_loss']:.6E} |"
            )
            + "".join(
                f" {n} loss: {'nan' if v is None else f'{v:.6E}'} tokens: {m['source_tokens'][n]} |"
                for n, v in (m.get("source_loss") or {}).items()
            )
        )
        self.write_metrics(m)
        self.observer.write(m)

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Appends ``record`` as one JSON line to --metrics-file (logging rank only)."""
        if self.is_logger and self.cfg.train.metrics_file:
            with open(self.cfg.train.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")

    def save(self) -> None:
        ck = self.cfg.checkpoint
        assert ck.save is not None
        if dist.get_rank() == 0:
            os.makedirs(ck.save, exist_ok=True)
            with open(os.path.join(ck.save, HF_CONFIG_NAME), "w") as f:
                json.dump(self.hf_config, f, indent=2)
            lora = run_lora_spec(self.cfg.model, self.arch)
            if lora is not None:  # which adapters the checkpoints hold, for mmpack convert
                write_run_config(ck.save, lora, self.cfg.model.hf_model)
        assert self.writer is not None
        if self.cfg.parallel.overlap_param_gather:  # the updated parameters are otherwise gathered lazily
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)
        self.writer.save(
            self.iteration, self.chunks, self.optimizer, self.scheduler, self.train_data.state_dict(),
            self.hf_config,
        )  # fmt: skip
        self.saved_iteration = self.iteration
        self.log_text(f"saved checkpoint at iteration {self.iteration} to {ck.save}")

    def train(self) -> None:
        """Steps up to --train-iters, or up to the step after which the exit policy stops the run (a signal,
        the duration, the exit interval); the last step is saved with --save either way."""
        tr, ck = self.cfg.train, self.cfg.checkpoint
        self.log_text(self.describe())
        self.log_text(self.trainable_message)
        stop: str | None = None
        while self.iteration < tr.train_iters and stop is None:
            metrics = self.train_step()
            if metrics["skipped"]:
                self.log_text(f"iteration {self.iteration}: skipped (gradient overflow), loss scale lowered")
            if self.iteration % tr.log_interval == 0 or metrics["skipped"]:
                if self.source_metrics is not None:
                    metrics |= self.source_metrics.take()
                self.log_metrics(metrics)
                self.observer.write_timers(self.iteration, normalizer=1.0)
            if tr.eval_interval and self.iteration % tr.eval_interval == 0:
                loss = self.evaluate()
                self.log_text(
                    f" validation loss at iteration {self.iteration} | lm loss: {loss:.6E} |"
                    f" loss reduction: {tr.loss_reduction} |"
                )
                self.write_metrics({"iteration": self.iteration, "eval_loss": loss})
            if ck.save and ck.save_interval and self.iteration % ck.save_interval == 0:
                self.save()
            if self.writer is not None:
                self.writer.finalize()  # completes async saves that have finished
            if self.iteration < tr.train_iters:  # the same on every rank: the check is collective
                stop = self.exit_policy.reason(self.iteration)
        if ck.save and self.saved_iteration != self.iteration:
            self.save()
        if self.writer is not None:
            self.writer.close()  # waits for an async save still being written
        if self.raw_rejects is not None:
            self.log_text(self.raw_rejects.summary(self.train_data))
        if stop is not None:
            where = f"; checkpoint of it in {ck.save} (resume with --load {ck.save})" if ck.save else ""
            self.log_text(f"exiting after iteration {self.iteration}: {stop}{where}")

    def close(self) -> None:
        """Stops data workers, closes the metric writers."""
        self.observer.close()
        for data in (self.train_data, self.eval_data):
            if data is not None:
                data.close()

    def describe(self) -> str:
        c = self.cfg
        prec = "bf16" if c.precision.bf16 else "fp16" if c.precision.fp16 else "fp32"
        return (
            f"mmpack trainer: world {dist.get_world_size()} = TP {c.parallel.tensor_model_parallel_size} x "
            f"PP {c.parallel.pipeline_model_parallel_size} x "
            f"{f'CP {cp} x ' if (cp := c.parallel.context_parallel_size) > 1 else ''}DP "
            f"{self.dp_size} | {prec} | "
            f"backend {'cpu/gloo' if self.on_cpu else 'cuda/nccl'} | attention "
            f"{'THD cu_seqlens (TE)' if self.use_te else 'block-diagonal mask'} | seq {c.train.seq_length} | "
            f"micro {c.train.micro_batch_size} x {self.num_micro} micro-batches x DP {self.dp_size} = "
            f"global {c.train.global_batch_size} | language layers per stage {self.layers_per_stage()} | data "
            f"{self.data_label()}"
        )

    def data_label(self) -> str:
        d = self.cfg.data
        if d.data_mixture:
            shares = " ".join(
                f"{s.weight or s.repeat}x {n}={s.path}"
                for s, n in zip(d.data_mixture.sources, d.source_names)
            )
            return f"mixture {shares}"
        if d.raw_inputs:
            return f"raw records {' '.join(d.raw_inputs)} (--online-packing, buffer {d.packing_buffer_size} records)"
        return d.data_path or "synthetic (--mock-data)"

    def layers_per_stage(self) -> str:
        """megatron-core's split of the language layers over the pipeline stages, e.g. "1,3"; under the
        interleaved pipeline also each stage's chunks by their global layers, e.g. "2,2 (chunks: 0-0,2-2 |
        1-1,3-3)"."""
        config, pp = self.mcfg.language, self.cfg.parallel.pipeline_model_parallel_size
        vp = self.virtual_pipeline_size
        layout = config.pipeline_model_parallel_layout
        if layout is not None:  # get_num_layers_to_build would count this rank's stage for every pp_rank
            return ",".join(str(layout.get_num_layers_to_build(pp_rank=r)) for r in range(pp))  # type: ignore[union-attr]
        if not vp:
            return ",".join(str(get_num_layers_to_build(config, pp_rank=r)) for r in range(pp))
        stages = []
        for r in range(pp):
            parts = []
            for v in range(vp):
                first = get_transformer_layer_offset(config, vp_stage=v, pp_rank=r)
                parts.append((first, get_num_layers_to_build(config, vp_stage=v, pp_rank=r)))
            stages.append(parts)
        counts = ",".join(str(sum(n for _, n in parts)) for parts in stages)
        chunks = " | ".join(",".join(f"{a}-{a + n - 1}" for a, n in parts) for parts in stages)
        return f"{counts} (chunks: {chunks})"


def _same_folder(a: str, b: str) -> bool:
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def shutdown() -> None:
    """Destroy process groups (lets torchrun exit cleanly)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
