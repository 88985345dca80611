"""TPExecutor: one engine over N tensor-parallel ranks, one process per rank (torch.distributed).

    engine process = rank 0: scheduler, its ModelRunner on slice 0, the sampler
    ranks 1..N-1: torch.multiprocessing "spawn" processes, each a ModelRunner on its slice

Every step rank 0 sends the step's `SchedulerOutput` (plain data, core/scheduler_output.py)
to the other ranks with `broadcast_object_list`, then all ranks run the same forward pass on
their slices (model/parallel.py: the all-reduces after o and down, the vocabulary-parallel
embedding, the logits gathered on rank 0). Only rank 0 samples; the tokens it sampled ride
along with the next step's broadcast so every rank appends the same token to its copy of each
request (the runners' states stay identical, so every rank takes the same code path and the
collectives match). Ranks talk only through torch.distributed: the TCPStore that rendezvouses
the group also carries each rank's "loaded" / error line at start-up (so a model that a rank
cannot load fails the engine at once, with that rank's message, instead of a collective
waiting for its timeout), and the process group (gloo on CPU, NCCL on CUDA) carries the rest.

Failure and shutdown:
- a rank that dies (killed, crashed) breaks the group: the collective on rank 0 raises (gloo
  sees the closed connection), or the liveness check before each step sees the exit. The
  executor is then dead: that step and every later one raise `RankFailedError`, which the
  engine turns into finish reason "error" for the step's requests (the clients get an
  error, nothing hangs). A rank stuck without dying is bounded by the group's timeout.
- `shutdown()` releases the ranks (a None broadcast), joins them and kills any straggler; at
  interpreter exit a finaliser terminates them; and each rank watches its parent and exits
  when the engine process is gone (the server leaves with os._exit, skipping atexit).

`kv_cache_memory` is per rank (as vLLM's per-GPU budget): a rank's block holds only its KV
heads, so the same budget holds N times the blocks of TP = 1. `threads_per_replica` sets
each rank's OpenMP team (default: the cores divided by N).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from iterserve.core.scheduler_output import SampleResult, SchedulerOutput
from iterserve.errors import ConfigError, ModelLoadError, RankFailedError

log = logging.getLogger(__name__)

# A collective that waits longer than this for a rank that is alive but stuck raises (a rank
# that dies is seen at once). Start-up waits for model loads by polling, not by collectives.
COLLECTIVE_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 5.0


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # pragma: no cover - not Linux
        return os.cpu_count() or 1


def rank_threads(args: Any, world: int) -> int:
    return args.threads_per_replica or max(1, _cpu_count() // world)


def _backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def _rank_device(device: str, rank: int) -> str:
    """cuda -> cuda:<rank> (one GPU per rank); the CPU stays the CPU."""
    return f"cuda:{rank}" if str(device).startswith("cuda") else str(device)


def _load_shard(args: Any, rank: int, world: int):
    # torch: the kernels and the model layer load in the rank process, not with the engine
    from iterserve.model import kernels
    from iterserve.model.loader import load_model
    from iterserve.model.parallel import Shard
    # each rank process has its own kernel configuration
    kernels.configure(kernels.KernelConfig.from_knobs(args.create_kernel_config()))
    return load_model(args.model, dtype=args.dtype, device=_rank_device(args.device, rank),
                      kv_cache_dtype=args.kv_cache_dtype, shard=Shard(rank, world),
                      tokenizer=getattr(args, "tokenizer", None),
                      hf_overrides=getattr(args, "hf_overrides", None))


def _make_runner(loaded, cache: tuple[int, int, int]):
    from iterserve.model.runner import ModelRunner   # torch: in the rank process only
    num_blocks, block_size, num_swap = cache
    return ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size,
                       num_swap_blocks=num_swap)


def _is_group_error(exc: BaseException) -> bool:
    """True for an error of torch.distributed itself (a peer gone, a timeout), not of the
    step's data (those happen on every rank alike and leave the group usable)."""
    import torch.distributed as dist     # torch: in the rank process only
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("gloo", "Connection closed", "Connection reset",
                                   "NCCL", "Timed out", "timed out"))


# --- ranks 1..N-1 ---------------------------------------------------------------------------

def _watch_parent(parent_pid: int) -> None:
    """Exit when the engine process is gone (its children are reparented)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(0)
    threading.Thread(target=watch, name="iterserve-tp-parent-watch", daemon=True).start()


def _rank_main(rank: int, world: int, args: Any, host: str, port: int, parent_pid: int,
               threads: int) -> None:
    """One rank: load its slice, join the group, then run every step rank 0 broadcasts."""
    _watch_parent(parent_pid)
    # torch: after the parent watch is up, so a rank whose parent died while torch loads exits
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    key = f"iterserve/tp/loaded/{rank}"
    try:
        if str(args.device).startswith("cuda"):
            torch.cuda.set_device(rank)
        loaded = _load_shard(args, rank, world)
    except BaseException as e:               # rank 0 raises this message for us
        store.set(key, f"error: {type(e).__name__}: {e}")
        return
    store.set(key, "ok")
    dist.init_process_group(_backend(args.device), store=store, rank=rank, world_size=world,
                            timeout=timeout)
    try:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        err = None
        try:
            runner = _make_runner(loaded, box[0])
        except Exception as e:
            err = f"rank {rank}: {type(e).__name__}: {e}"
        statuses: list[Any] = [None] * world
        dist.all_gather_object(statuses, err)
        if any(statuses):
            return
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            sampled, output = box[0]
            for rid, tokens in sampled.items():     # rank 0's tokens of the previous step
                st = runner.requests.get(rid)
                if st is not None:
                    for token in tokens:            # (several after a verification)
                        st.append(token)
            try:
                runner.compute_logits(output)
            except Exception as e:
                if _is_group_error(e):
                    raise
                # the step's data was bad: rank 0 met the same error before any collective
                log.warning("step %d failed on rank %d: %s", output.step, rank, e)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


# --- rank 0 -------------------------------------------------------------------------------

def _stop_ranks(procs: list, timeout: float = JOIN_TIMEOUT_S) -> None:
    """Join the rank processes, terminating then killing those that do not exit."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


class TPExecutor:
    """The Executor protocol (engine/interfaces.py) over N ranks; rank 0 is this process."""

    def __init__(self, args: Any, kv_cache_config: Callable[[Any, Any], Any]) -> None:
        # torch: only a tensor-parallel engine loads it on the engine side
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp

        world = int(args.tensor_parallel_size)
        if world < 2:
            raise ConfigError("TPExecutor needs tensor_parallel_size >= 2", "tensor_parallel_size")
        if dist.is_available() and dist.is_initialized():
            raise ConfigError("a tensor-parallel engine (or another torch.distributed group) "
                              "is already running in this process; shut it down first",
                              "tensor_parallel_size")
        if str(args.device).startswith("cuda") and torch.cuda.device_count() < world:
            raise ConfigError(f"tensor_parallel_size {world} on CUDA needs {world} GPUs, this "
                              f"machine has {torch.cuda.device_count()}", "tensor_parallel_size")
        from iterserve.model.parallel import check_model    # torch: the engine imports none
        check_model(args.model, world)          # a split the model cannot take: no spawn
        self.world_size = world
        self.threads = rank_threads(args, world)
        self._prev_threads = torch.get_num_threads()
        self._dead: str | None = None
        self._closed = False
        self._group = False
        self._pending: dict[str, int] = {}
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        host = "127.0.0.1"
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_rank_main, name=f"iterserve-tp-rank{r}", daemon=True,
                                  args=(r, world, args, host, store.port, os.getpid(),
                                        self.threads))
                      for r in range(1, world)]
        for p in self.procs:
            p.start()
        self._finalizer = weakref.finalize(self, _stop_ranks, list(self.procs), 0.0)
        try:
            torch.set_num_threads(self.threads)
            if str(args.device).startswith("cuda"):
                torch.cuda.set_device(0)
            self.loaded = _load_shard(args, 0, world)       # while the others load theirs
            self._wait_loaded(store)
            dist.init_process_group(_backend(args.device), store=store, rank=0,
                                    world_size=world, timeout=timeout)
            self._group = True
            self.cache_config = kv_cache_config(args, self.loaded)
            c = self.cache_config
            cache = (c.num_kv_blocks, c.block_size, c.num_swap_blocks)
            dist.broadcast_object_list([cache], src=0)
            err = None
            try:
                self.runner = _make_runner(self.loaded, cache)
            except Exception as e:
                err = f"rank 0: {type(e).__name__}: {e}"
            statuses: list[Any] = [None] * world
            dist.all_gather_object(statuses, err)
            bad = [s for s in statuses if s]
            if bad:
                raise RankFailedError("tensor-parallel start-up failed: " + "; ".join(bad))
        except BaseException:
            self._teardown(release=False)
            raise
        log.info("tensor parallel: %d ranks (pids %s), %d threads each, %s backend; decode "
                 "runs per op (the fused decode layers cannot all-reduce mid-layer)", world,
                 [os.getpid()] + [p.pid for p in self.procs], self.threads,
                 _backend(args.device))

    def _wait_loaded(self, store) -> None:
        """Each rank's "ok" or error line; a rank that exits without one fails at once."""
        for r, p in enumerate(self.procs, start=1):
            key = f"iterserve/tp/loaded/{r}"
            while not store.check([key]):
                if not p.is_alive():
                    raise RankFailedError(f"tensor-parallel rank {r} exited (code {p.exitcode}) "
                                          "while loading its slice of the model")
                time.sleep(0.02)
            status = store.get(key).decode()
            if status != "ok":
                raise ModelLoadError(f"tensor-parallel rank {r}: {status}")

    # --- the Executor protocol --------------------------------------------------------------
    @property
    def config(self):
        return self.loaded.config

    @property
    def requests(self):
        return self.runner.requests

    @property
    def sampler(self):
        return self.runner.sampler

    @property
    def thread_adapter(self):
        """Rank 0's compute-team choice (every rank runs the same fixed share)."""
        return self.runner.thread_adapter

    @sampler.setter
    def sampler(self, fn) -> None:
        self.runner.sampler = fn

    @property
    def fatal_error(self) -> str | None:
        """Set once a rank has died: the engine can run no step any more (/health: 503)."""
        return self._dead

    @property
    def memory_plan(self) -> dict:
        """Rank 0's plan (every rank holds a slice of the same shape) and the group."""
        return dict(self.runner.memory_plan, tensor_parallel={
            "size": self.world_size, "rank_pids": [os.getpid()] + [p.pid for p in self.procs],
            "threads_per_rank": self.threads, "decode_path": "per-op",
            "dead": self._dead})

    @property
    def rank_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def execute(self, output: SchedulerOutput) -> dict[str, SampleResult]:
        results = self._step(output, self.runner.execute)
        self._pending = {rid: r.token_ids for rid, r in results.items()}
        return results

    def compute_logits(self, output: SchedulerOutput):
        """Rank 0's gathered float32 logits of the sampling rows (samples nothing)."""
        return self._step(output, self.runner.compute_logits)

    def _step(self, output: SchedulerOutput, run):
        import torch.distributed as dist     # torch: loaded by __init__ already; kept off module import
        self._check_alive()
        sent = output if output.grammar_bitmask is None \
            else dataclasses.replace(output, grammar_bitmask=None)   # rank 0 applies it
        pending, self._pending = self._pending, {}
        try:
            dist.broadcast_object_list([(pending, sent)], src=0)
            return run(output)
        except Exception as e:
            if _is_group_error(e) or not self._ranks_alive():
                cause = str(e).split(". ")[0].split("] ")[-1][:200]     # gloo's first sentence
                self._mark_dead(f"{type(e).__name__}: {cause}")
                raise RankFailedError(self._dead) from e
            raise

    def _ranks_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _check_alive(self) -> None:
        if self._closed:
            raise RankFailedError("the tensor-parallel executor is shut down")
        if self._dead is None and not self._ranks_alive():
            self._mark_dead("")
        if self._dead is not None:
            raise RankFailedError(self._dead)

    def _mark_dead(self, why: str) -> None:
        if self._dead is not None:
            return
        time.sleep(0.05)                 # let a dying rank's exit code land
        gone = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, 1)
                if not p.is_alive()]
        self._dead = ("tensor-parallel " + (", ".join(gone) + " died" if gone else
                                           "group failed") + (f": {why}" if why else ""))
        log.error("%s; every later step fails", self._dead)

    # --- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the ranks, join them (killing stragglers) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        self._teardown(release=self._dead is None)

    def _teardown(self, release: bool) -> None:
        # torch: loaded by __init__ already; kept off module import
        import torch
        import torch.distributed as dist
        if release and self._group:
            try:
                dist.broadcast_object_list([None], src=0)
            except Exception:
                pass
        _stop_ranks(self.procs, JOIN_TIMEOUT_S if release else 0.0)
        self._finalizer.detach()
        if self._group:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
            self._group = False
        torch.set_num_threads(self._prev_threads)

    def __enter__(self) -> "TPExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
