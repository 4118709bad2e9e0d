import sys

from offline_packing.cli import main

sys.exit(main())
