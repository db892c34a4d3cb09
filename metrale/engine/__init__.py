"""The engine room: everything that turns queued requests into streamed tokens.

    async_engine.py   AsyncEngine, the public embeddable engine (submission, lifecycle, stats)
    llm.py            LLM, the blocking API: the AsyncEngine on a background thread with its own loop
    core.py           EngineCore, the step loop: schedule -> execute on the MLX thread -> postprocess
    runner.py         ModelRunner: the model, the KV pools and the sampler; one batched forward per step
    stream.py         RequestStream / OutputChannel: the per-request async token stream
    request_state.py  the event-loop side of one request: its text front-end, timings, channel
    mlx_thread.py     the one thread where MLX runs
    metrics.py        the Prometheus series
    protocol.py       EngineClient: the typed interface the server and the load generator use

Importing this package loads nothing heavy; `metrale.engine.async_engine` loads MLX.
"""
