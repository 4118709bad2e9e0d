"""Where a stage's independent chunks run: `local` (forked worker processes on this machine)."""
