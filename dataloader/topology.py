"""Where this process sits in the TP x PP x DP grid, as far as data is concerned."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Data-parallel, tensor-parallel and pipeline-parallel rank and size of one process.

    Only the DP coordinate decides which bins a rank reads: TP and PP peers of one DP rank would read the
    same bins, so the trainer builds a loader on one of them and broadcasts (`mmpack.trainer.shared_batches`).
    """

    dp_rank: int
    dp_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1:
                raise ValueError(f"{name}_size must be >= 1, got {size}")
            if not 0 <= rank < size:
                raise ValueError(f"{name}_rank must be in [0, {size}), got {rank}")

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size * self.pp_size

    @classmethod
    def from_megatron(cls) -> Topology:
        """Reads ranks and sizes from megatron-core's `parallel_state` (must be initialised)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron-core parallel_state is not initialised; call "
                "parallel_state.initialize_model_parallel(...) before Topology.from_megatron()"
            )
        return cls(
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
        )
