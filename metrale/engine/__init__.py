"""The engine room: everything that turns queued requests into streamed tokens.

    async_engine.py   AsyncEngine, the public embeddable engine (lifecycle, health, stats)
    startup.py        loading the model and building its runner on the MLX thread under the runtime settings
    submission.py     Submission: validate, tokenize (long prompts off the loop), queue; refusals counted once
    llm.py            LLM, the blocking API: the AsyncEngine on a background thread with its own loop
    core.py           EngineCore, the step loop: schedule -> execute on the MLX thread -> postprocess
    executor.py       StepExecutor: runs a step on the MLX thread, bisects a failed batch to its culprits
    step.py           the step's records: ForwardInput (one forward, also what TP ranks get) and RowResult
                      (one request's share of a step); msgspec Structs that cross processes as they are
    step_stats.py     StepStats: steps and finished requests into the metrics
    request_groups.py the sequences of one request with n > 1, which live and die together
    runner.py         ModelRunner: the model, the KV pools and the sampler; one batched forward per step
    stream.py         RequestStream / OutputChannel: the per-request async token stream
    request_state.py  the event-loop side of one request: its text front-end, timings, channel
    mlx_thread.py     the one thread where MLX runs
    metrics.py        the Prometheus series
    protocol.py       EngineClient: the typed interface the server and the load generator use

Importing this package loads nothing heavy; `metrale.engine.async_engine` loads MLX.
"""
