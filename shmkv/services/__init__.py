"""The services around the cache, off vLLM's hot path:

    daemon.py           `python -m shmkv.daemon`: the maintainer and the controller in one process
    maintainer.py       the maintainer role: spill ahead, watermark eviction, reclaim, size repair
    controller.py       the controller API's endpoints (lookup, clear, pin, move, flush, compress, ...)
    controller_http.py  its HTTP transport: loopback TCP or a 0600 unix socket
    stats.py            `python -m shmkv.stats`: what the cache is doing, from the segment

May import the store, the tiers (through the chain), keys, config and paths;
never the transfer path or the integrations. shmkv/daemon.py and
shmkv/stats.py are the command-line entry points.
"""
