"""`python -m mmpack.offline_packing ARGS`: the offline job, as `mmpack pack ARGS`."""

import sys

from mmpack.offline_packing.pack_cli import main

sys.exit(main())
