"""What the job writes: shard writers (Arrow IPC, WebDataset tar) and the Megatron-Energon metadata."""
