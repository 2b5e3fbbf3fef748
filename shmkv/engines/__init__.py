"""The machinery that runs vLLM engines, servers and their neighbours for
`shmkv check`, the benchmarks (shmkv.bench) and the tests: random-weight
models written to disk (models), an engine in a process group of its own
(engine: EngineProcess, EngineSpec), forked from a warm server (forks),
`vllm serve` and a multi-instance host's routers (vllm_server), a Redis of
its own (redis_server), and what a started group leaves behind, removed by
ownership (owned_files, process_groups).

Invariant: nothing here measures (bench/ does) and nothing here imports
shmkv.bench; what a group started here made is removed by the harness that
ends it, never a neighbour's file."""
