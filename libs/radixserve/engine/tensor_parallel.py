"""A tensor-parallel engine's ranks: every rank runs the same scheduler, in step.

As in SGLang, each rank holds a scheduler of its own over its shard of the model and
of the KV heads, and all of them make the same decisions: rank 0 (the `Engine` the
caller made) sends the others what changed its scheduler since the last step (requests
added, aborts, a cache flush) with the step itself, once per step, down a pipe to each
(its child processes: a rank waits for the next step without a timeout, however long
the engine idles, and sees rank 0 gone at once as the pipe's end); the logits, summed
over the ranks inside the model, are the same bits on every rank, so every rank samples
the same tokens (seeds are per request) and retires the same requests. Only rank 0
reports outputs. A rank that exits stops rank 0 with `RankLost`, rather than leaving it
waiting in a collective: `RankWatch` sees the process go and aborts rank 0's device
collectives at once (a step, or the warm-up, then returns and raises), and each step
checks the ranks before it starts.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.constrained import GrammarBackend
from radixserve.engine.distributed import (
    abort_device_collectives,
    destroy_tp_group,
    init_tp_group,
)
from radixserve.engine.heap import settle_started_heap
from radixserve.engine.kvcache.base import PrefixCache
from radixserve.engine.kvcache.hiradix_cache import HiRadixCache
from radixserve.engine.kvcache.host_pool import block_store_for, host_pool_for
from radixserve.engine.kvcache.naive_cache import NaiveCache
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.kvcache.radix_cache import RadixCache
from radixserve.engine.request import Req
from radixserve.engine.runner import ModelRunner, resolve_device
from radixserve.engine.sampling.params import SamplingParams
from radixserve.engine.sched.finish import Detokenize
from radixserve.engine.sched.scheduler import Runner, Scheduler, StepOutput
from radixserve.model_files.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

# A rank process reaching run_rank (spawned: it imports torch and the caller's main
# module first). The collectives after it have their own timeout.
START_TIMEOUT_S = 120.0


class RankLost(RuntimeError):
    """A tensor-parallel rank's process exited: the engine cannot step without it."""


Ranks = list[multiprocessing.process.BaseProcess]


def _exited(ranks: Ranks) -> str | None:
    """Which rank's process has exited, if one has."""
    for rank, proc in enumerate(ranks, start=1):
        if not proc.is_alive():
            return _lost(rank, proc)
    return None


def _lost(rank: int, proc: multiprocessing.process.BaseProcess) -> str:
    code = proc.exitcode  # None where another thread reaps it at this moment
    return (
        f"tensor-parallel rank {rank} exited{'' if code is None else f' (code {code})'}; "
        "the engine cannot go on without it"
    )


class RankWatch:
    """Rank 0's watch over the other ranks' processes (a thread). When one exits unasked,
    rank 0 may be inside a device collective that waits for it with no timeout (NCCL's
    kernels; torch.distributed's watchdog only after `dist_timeout_s`): the watch
    notes which rank (`lost`) and aborts this process's device collectives, so that call
    returns and rank 0 raises `RankLost` (`check`) instead of hanging."""

    def __init__(self, ranks: Ranks, poll_s: float = 0.5) -> None:
        self.ranks = ranks
        self.lost: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(poll_s,), daemon=True, name="tp-rank-watch"
        )
        self._thread.start()

    def _run(self, poll_s: float) -> None:
        sentinels = [proc.sentinel for proc in self.ranks]
        ready: list[Any] = []
        while not ready and not self._stopped.is_set():
            ready = wait(sentinels, timeout=poll_s)
        if self._stopped.is_set():
            return
        rank, proc = next((r, p) for r, p in enumerate(self.ranks, 1) if p.sentinel in ready)
        proc.join(1.0)  # its sentinel closes a moment before it can be reaped
        self.lost = _lost(rank, proc)
        log.error("%s: aborting this rank's device collectives", self.lost)
        abort_device_collectives()

    def check(self, cause: BaseException | None = None) -> None:
        """Raise `RankLost` if a rank was lost (from `cause`, what that made fail)."""
        if self.lost is not None:
            raise RankLost(self.lost) from cause

    def stop(self) -> str | None:
        """Before the ranks are stopped on purpose: which rank had exited already, if
        one had (seen by the watch or not yet)."""
        self._stopped.set()
        self._thread.join(5.0)
        return self.lost or _exited(self.ranks)


@dataclass(frozen=True)
class ReqSpec:
    """What a rank needs to build the same `Req` as rank 0 (a grammar is compiled again
    from the request's own parameters: compiled grammars do not travel)."""

    rid: str
    origin_input_ids: list[int]
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]
    constrained: bool
    # Admission order (sched/policy.py): the arrival on rank 0's clock, as each step's now.
    priority: int
    arrival_time: float | None
    resume_ids: list[int]  # a resumed request's output tokens from another worker

    @classmethod
    def of(cls, req: Req) -> ReqSpec:
        return cls(
            req.rid,
            list(req.origin_input_ids),
            req.params,
            req.seed,
            req.stop_token_ids,
            req.grammar is not None,
            req.priority,
            req.arrival_time,
            req.output_ids[: req.resumed],
        )


# ("add", ReqSpec) | ("abort", rid) | ("flush",) | ("step", now) | ("stop",)
Command = tuple[Any, ...]


class ReplicatedScheduler(Scheduler):
    """Rank 0's scheduler: records what changes it, and sends that to the other ranks
    with each step (they replay it on their own schedulers, `run_rank`)."""

    def __init__(self, *args: Any, others: OtherRanks, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.others = others
        self._log: list[Command] = []

    def add_request(self, req: Req) -> None:
        super().add_request(req)  # stamps its arrival, which the ranks then take
        self._log.append(("add", ReqSpec.of(req)))

    def abort(self, rid: str) -> bool:
        self._log.append(("abort", rid))
        return super().abort(rid)

    def flush_cache(self) -> bool:
        self._log.append(("flush",))
        return super().flush_cache()

    def step(self) -> list[StepOutput]:
        now = self.clock()  # one reading for every rank: they admit alike
        commands, self._log = [*self._log, ("step", now)], []
        self.others.send(commands)
        try:
            outputs = super().step_at(now)
        except Exception as exc:  # a collective the watch aborted, say
            self.others.watch.check(exc)
            raise
        # A step whose collectives were aborted returns garbage: none of it goes out.
        self.others.watch.check()
        return outputs


class OtherRanks:
    """Ranks 1 .. N-1 as rank 0 holds them: their processes, the pipes that carry each
    step's commands to them, and the watch over them (`start` starts them)."""

    def __init__(self, procs: Ranks, channels: list[Connection]) -> None:
        self.procs = procs
        self.channels = channels
        self.watch = RankWatch(procs)

    @classmethod
    def start(cls, config: EngineConfig, address: str) -> OtherRanks:
        return cls(*start_ranks(config, address))

    def exited(self) -> str | None:
        """Which rank has exited, if one has (not waiting for the watch to notice)."""
        return _exited(self.procs)

    def send(self, commands: list[Command]) -> None:
        """`commands` to every rank (pickled once); `RankLost` if one is gone."""
        lost = self.exited()
        if lost is not None:
            raise RankLost(lost)
        data = pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, channel in enumerate(self.channels, start=1):
            try:
                channel.send_bytes(data)
            except OSError as exc:  # its reading end closed: the rank is going
                raise RankLost(f"tensor-parallel rank {rank} stopped reading ({exc!r})") from exc

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell the ranks to exit, and wait for them. With one gone, the others cannot be
        told (and may wait in a collective): they are killed."""
        self.watch.stop()
        try:
            self.send([("stop",)])
        except RankLost:
            timeout_s = 0.0
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for channel in self.channels:
            channel.close()

    def abandon(self) -> str | None:
        """Kill the ranks (rank 0 failed to start): which one had exited first, if one
        had (what made rank 0 fail, then)."""
        lost = self.watch.stop()
        _kill(self.procs, self.channels)
        return lost


def build_scheduler(
    config: EngineConfig,
    runner: ModelRunner,
    detokenize: Detokenize,
    scheduler_class: type[Scheduler] = Scheduler,
    **extra: Any,
) -> Scheduler:
    """The scheduler over `runner`'s pools, with the prefix cache the config asks for."""
    cache: PrefixCache
    if config.disable_radix_cache:
        cache = NaiveCache(runner.kv_pool)
    elif config.hicache_size_gb:
        host_pool = host_pool_for(runner.kv_pool, config.hicache_size_gb)
        store = None
        if config.hicache_storage_dir:
            store = block_store_for(config, runner.kv_pool)
        cache = HiRadixCache(runner.kv_pool, host_pool, config.hicache_write_policy, store)
    else:
        cache = RadixCache(runner.kv_pool)
    pools: tuple[Runner, KVPool, ReqToTokenPool] = (runner, runner.kv_pool, runner.req_pool)
    return scheduler_class(
        config, *pools, cache, runner.context_len, detokenize=detokenize, **extra
    )


def start_ranks(
    config: EngineConfig, address: str, timeout_s: float = START_TIMEOUT_S
) -> tuple[Ranks, list[Connection]]:
    """Start ranks 1 .. tp_size - 1 (each joins the group at `address`) and wait
    until each runs: one that exits first (its main module failed to import, say) is an
    error now, not a wait in the group's rendezvous for its timeout. Returns the ranks'
    processes and rank 0's ends of the pipes that carry each step's commands to them."""
    context = multiprocessing.get_context("spawn")  # no forked CUDA or thread state
    kwargs = dataclasses.asdict(config)
    ranks: Ranks = []
    channels: list[Connection] = []
    started: list[Any] = []  # multiprocessing Events: set by each rank as it starts
    try:
        for rank in range(1, config.tp_size):
            started.append(context.Event())
            reader, writer = context.Pipe(duplex=False)
            channels.append(writer)
            proc: multiprocessing.process.BaseProcess = context.Process(
                target=run_rank,
                args=(kwargs, rank, address, os.getpid(), started[-1], reader),
                name=f"radixserve-tp{rank}",
                daemon=True,
            )
            proc.start()
            reader.close()  # the rank's copy only: a write to a rank gone then fails
            ranks.append(proc)
        _wait_started(ranks, started, timeout_s)
    except BaseException:
        _kill(ranks, channels)
        raise
    return ranks, channels


def _kill(ranks: Ranks, channels: list[Connection]) -> None:
    """End ranks that rank 0 gives up on (they would wait out the collective timeout for
    it), and close its ends of their pipes."""
    for proc in ranks:
        proc.kill()
    for channel in channels:
        channel.close()


def _wait_started(ranks: Ranks, started: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for rank, (proc, event) in enumerate(zip(ranks, started, strict=True), start=1):
        while not event.wait(0.1):
            if not proc.is_alive():
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before it "
                    "started; its error is above. The ranks are spawned processes that "
                    "import the caller's main module: a script that starts a "
                    "tensor-parallel Engine must do so under `if __name__ == '__main__':`"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} did not start within {timeout_s:.0f} s"
                )


def run_rank(
    kwargs: dict[str, Any],
    rank: int,
    address: str,
    parent_pid: int,
    started: Any,
    commands: Connection,
) -> None:
    """A rank other than 0: build its shard, then replay rank 0's commands (read from
    `commands`) until "stop", or until rank 0 is gone."""
    started.set()  # the main module imported: start_ranks stops watching for an early exit
    _exit_with_parent(parent_pid)
    config = EngineConfig.from_kwargs(**kwargs)
    torch.manual_seed(config.random_seed)
    device = resolve_device(config.device)
    tp = init_tp_group(rank, config.tp_size, address, device, config.dist_timeout_s)
    runner: ModelRunner | None = None
    try:
        runner = ModelRunner(config, tp)
        tokenizer = load_tokenizer(runner.model_path)
        grammars = GrammarBackend(tokenizer, runner.vocab_size)
        scheduler = build_scheduler(
            config, runner, lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))
        )
        if not config.disable_gc_freeze:
            settle_started_heap()
        while _apply(_next_commands(commands), scheduler, grammars):
            pass
    finally:
        if runner is not None:  # its graphs' captured all-reduces would hold the teardown
            runner.close()
        destroy_tp_group(tp)


def _next_commands(channel: Connection) -> list[Command]:
    """Rank 0's next step, however long it idles first; "stop" if rank 0 is gone (the
    pipe's end: every writer closed)."""
    try:
        commands: list[Command] = pickle.loads(channel.recv_bytes())
    except EOFError:
        return [("stop",)]
    return commands


def _apply(commands: list[Command], scheduler: Scheduler, grammars: GrammarBackend) -> bool:
    """Replay one step's commands; False at "stop"."""
    for command in commands:
        kind = command[0]
        if kind == "add":
            scheduler.add_request(_req_of(command[1], grammars))
        elif kind == "abort":
            scheduler.abort(command[1])
        elif kind == "flush":
            scheduler.flush_cache()
        elif kind == "step":
            scheduler.step_at(command[1])
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"unknown tensor-parallel command {kind!r}")
    return True


def _req_of(spec: ReqSpec, grammars: GrammarBackend) -> Req:
    req = Req(
        rid=spec.rid,
        origin_input_ids=spec.origin_input_ids,
        params=spec.params,
        seed=spec.seed,
        stop_token_ids=spec.stop_token_ids,
        priority=spec.priority,
        arrival_time=spec.arrival_time,
    )
    if spec.constrained:
        compiled = grammars.compile_request(spec.params)
        assert compiled is not None, "a constrained request without a grammar"
        req.grammar = grammars.new_state(compiled, req.stop_token_ids, req.params)
    if spec.resume_ids:
        req.resume(spec.resume_ids)  # accepted on rank 0 already, so here too
    return req


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """End this rank when rank 0's process is gone (killed: nothing else would tell it)."""

    def watch(alive: Callable[[], bool]) -> None:
        while alive():
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(
        target=watch, args=(lambda: os.getppid() == parent_pid,), daemon=True, name="tp-parent"
    ).start()
