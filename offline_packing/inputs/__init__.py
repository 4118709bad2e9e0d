"""What the job reads: expansion of -i arguments into canonical input files and records chunk by chunk."""
