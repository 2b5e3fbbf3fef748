"""`python -m shmkv.stats` (and `shmkv stats`): what the cache is doing, read
from the segment itself; the tool is shmkv.services.stats."""

import sys

from shmkv.services.stats import main

if __name__ == "__main__":
    sys.exit(main())
