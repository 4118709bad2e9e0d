"""`python -m mmpack`: the `mmpack` command."""

from mmpack.offline_packing.cli import main

raise SystemExit(main())
