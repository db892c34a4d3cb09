"""Tensor parallelism: one model sharded over several processes of this machine with MLX's ring
backend (`metrale serve --tensor-parallel N`, `EngineConfig(tensor_parallel_size=N)`).

    launcher   ports, hostfile, the follower processes, joining the ring (rank 0 is the engine's process)
    group      rank 0's handle: sends each step's forward to the others, watches them, fails the group
    follower   ranks 1..N-1: `python -m metrale.distributed.follower`, one forward per message
    sharding   one rank's share of a loaded model (heads, MLP features; all_sum after o_proj / down_proj)
    messages   what rank 0 sends: FollowerSetup, KVLayout, then the engine's ForwardInput per step
               (metrale.engine.step: the step message is the engine's, this room uses it)
    channel    length-prefixed pickles over the pipes

Rank 0 runs the scheduler, the server and the sampler; every rank runs every forward. Importing this
package loads nothing; its modules load MLX. A one-rank engine never imports it.
"""
