import sys

from mmpack.offline_packing.cli import main

sys.exit(main())
