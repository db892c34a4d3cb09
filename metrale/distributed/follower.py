"""A follower rank of a tensor-parallel group: `python -m metrale.distributed.follower`.

Started by rank 0 (metrale.distributed.launcher) with MLX_RANK / MLX_HOSTFILE set; stdin carries rank
0's messages (metrale.distributed.messages), stdout its one-byte hello. Its life:

    read FollowerSetup -> hello -> join the ring -> load the model, keep this rank's share
    read KVLayout -> allocate its pools (its own kv heads) -> barrier
    loop: read a ForwardInput (blocked in read(), no CPU while the server is idle) -> run the forward,
          its all_sums in step with every other rank; nothing is sampled here
    end of stdin (rank 0 closed it or died): exit 0; any error: exit 1 (rank 0 sees its peer lost)

It exits with os._exit, skipping the interpreter's teardown, where a thread's MLX random key can abort the
process (kernels.runtime.release_thread_state).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from functools import partial

from kernels.backend import select_backends
from kernels.runtime import mx
from kernels.settings import applied
from kvcache.storage import PagedKVCache
from metrale.distributed.channel import recv_message
from metrale.distributed.launcher import join_ring
from metrale.distributed.messages import FollowerSetup, KVLayout
from metrale.distributed.sharding import shard_model
from metrale.engine.step import ForwardInput
from metrale.loading import load_model
from metrale.settings import RuntimeSettings

logger = logging.getLogger("metrale.distributed.follower")


def serve_steps(setup: FollowerSetup, inbox, rank: int, hostfile: str, settings: RuntimeSettings) -> None:
    """Join, load, then run every forward rank 0 sends until the end of `inbox`."""
    group = join_ring(rank, hostfile)
    dtype = None if setup.weights_dtype is None else getattr(mx, setup.weights_dtype)
    with applied(settings.kernels):
        loaded = load_model(setup.model, dtype=dtype, shard=partial(shard_model, group=group))
    layout = _expect(recv_message(inbox), KVLayout)
    if layout is None:
        return
    mc = loaded.config
    with applied(settings.kernels):
        kv_cache = PagedKVCache(mc.num_hidden_layers, layout.num_blocks, layout.block_size,
                                mc.num_key_value_heads // setup.size, mc.head_dim, getattr(mx, layout.kv_dtype))
    backend = select_backends(settings.kernels).attention
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # the startup barrier
    logger.info("rank %d serving steps: %s, %d KV blocks", rank, loaded.describe_quantization(), layout.num_blocks)
    while (forward := _expect(recv_message(inbox), ForwardInput)) is not None:
        hidden = forward.run(loaded.model, kv_cache, backend)  # (T, D)
        pools = [pool for layer in range(kv_cache.num_layers) for pool in kv_cache.layer(layer)]
        mx.eval(hidden, pools)


def _expect(message, kind):
    if message is not None and not isinstance(message, kind):
        raise TypeError(f"expected a {kind.__name__} from rank 0, got {type(message).__name__}")
    return message


def main() -> None:
    rank = int(os.environ["MLX_RANK"])
    settings = RuntimeSettings.resolve()  # this rank's own environment, inherited from rank 0
    logging.basicConfig(level=settings.log_level,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    hello = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints go to stderr: stdout is the hello channel
    inbox = sys.stdin.buffer
    status = 0
    try:
        setup = _expect(recv_message(inbox), FollowerSetup)
        if setup is not None:
            hello.write(b"R")
            serve_steps(setup, inbox, rank, os.environ["MLX_HOSTFILE"], settings)
    except BaseException:  # noqa: BLE001  (logged; rank 0 sees its peer lost and fails the group)
        logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        status = 1
    logging.shutdown()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
