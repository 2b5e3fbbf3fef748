"""`python -m shmkv`: the `shmkv` command (shmkv.cli)."""

import sys

from shmkv.cli import main

sys.exit(main())
