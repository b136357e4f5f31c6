"""Starting workers: `train.py --nproc N`, torchrun, or one plain process.

Three ways in, one worker function:
  * `python train.py` (nproc 1): the worker runs in this process, no
    torch.distributed at all (every process group has size 1).
  * `python train.py --nproc N`: we start N local workers with PyTorch's
    elastic launcher (the machinery behind `torchrun`), on a free loopback
    port, restarting them up to --max-restarts times after a failure.
  * `torchrun --nproc_per_node N [--nnodes ...] train.py ...`: torchrun
    started us; RANK / WORLD_SIZE / LOCAL_RANK come from the environment.

After a restart the new workers resume from the newest complete checkpoint
(train.py asks `restart_count()`). One PyTorch wrinkle: since torch 2.5 the
workers share the launcher's rendezvous store by default, and a restarted
group can read the dead group's addresses from it and fail to connect
(pytorch/pytorch#135712). `spawn` therefore gives every attempt its own store
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a documented PyTorch runtime variable);
under `torchrun --max-restarts` set it yourself (`torchrun_restart_warning`).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when a launcher started this process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def restart_count() -> int:
    """How often the launcher (torchrun, or train.py --max-restarts) has
    restarted this worker group after a failure; 0 on the first start. A
    restarted job resumes from its newest checkpoint, whatever --resume said."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(entry, args: tuple, nproc: int, max_restarts: int = 0) -> int:
    """Run entry(*args) in nproc local workers; returns an exit code.

    A worker that dies (exception, exit code, SIGKILL) makes the launcher stop
    all the others promptly, then restart the group (up to max_restarts) or
    report which rank failed and why.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts, monitor_interval=0.2, start_method="spawn",
    )
    saved = os.environ.get(_OWN_STORE)
    os.environ[_OWN_STORE] = "1"    # a fresh store per attempt (see the module docstring)
    try:
        elastic_launch(config, entry)(*args)
        return 0
    except ChildFailedError as e:
        codes = []
        for rank, failure in sorted(e.failures.items()):
            code = failure.exitcode
            codes.append(code)
            msg = failure.message if isinstance(failure.message, str) else ""
            reason = (msg.strip().splitlines() or [""])[-1] if msg else ""
            signal = f" (signal {failure.signal_name()})" if code < 0 else ""
            print(f"error: rank {rank} failed with exit code {code}{signal}{': ' + reason if reason else ''}",
                  file=sys.stderr)
        return 2 if codes and all(c == 2 for c in codes) else 1
    finally:
        if saved is None:
            os.environ.pop(_OWN_STORE, None)
        else:
            os.environ[_OWN_STORE] = saved


_OWN_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def torchrun_restart_warning() -> str | None:
    """A warning for `torchrun --max-restarts R` runs that share the agent's
    store (TORCHELASTIC_* variables are set by torchrun for its workers)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"warning: torchrun --max-restarts {restarts} with a shared rendezvous store: restarted workers "
                f"may fail to connect (pytorch/pytorch#135712); start torchrun with "
                f"{_OWN_STORE}=1 in its environment")
    return None
