"""`mmpack stats`: packing efficiency of a packed dataset or of a length file.

cli.py (flags, report assembly), inputs.py (length files, streamed), dataset.py (a packed dataset's bins),
report.py (text report, length distribution), compare.py (`--compare`: every algorithm side by side),
plot.py (`--plot`).
"""
