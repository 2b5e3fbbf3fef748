"""`python -m shmkv.daemon` (and `shmkv daemon`): the cache's maintainer and
controller in one process; the service itself is shmkv.services.daemon."""

import sys

from shmkv.services.daemon import main

if __name__ == "__main__":
    sys.exit(main())
