"""`python -m mmpack`: the `mmpack` command."""

from mmpack.cli import main

raise SystemExit(main())
