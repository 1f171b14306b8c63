"""A tensor-parallel engine's ranks: every rank runs the same scheduler, in step.

As in SGLang, each rank holds a scheduler of its own over its shard of the model and
of the KV heads, and all of them make the same decisions: rank 0 (the `Engine` the
caller made) sends the others what changed its scheduler since the last step (requests
added, aborts, a cache flush) with the step itself, once per step; the logits, summed
over the ranks inside the model, are the same bits on every rank, so every rank samples
the same tokens (seeds are per request) and retires the same requests. Only rank 0
reports outputs. A rank that exits stops rank 0 at its next step (`RankLost`), rather
than leaving it waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.constrained import GrammarBackend
from radixserve.engine.distributed import TPGroup, destroy_tp_group, init_tp_group
from radixserve.engine.kvcache.base import PrefixCache
from radixserve.engine.kvcache.naive_cache import NaiveCache
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.kvcache.radix_cache import RadixCache
from radixserve.engine.model.tokenizer import load_tokenizer
from radixserve.engine.request import Req
from radixserve.engine.runner import ModelRunner, resolve_device
from radixserve.engine.sampling.params import SamplingParams
from radixserve.engine.sched.finish import Detokenize
from radixserve.engine.sched.scheduler import Runner, Scheduler, StepOutput

log = logging.getLogger(__name__)

# A rank process reaching run_rank (spawned: it imports torch and the caller's main
# module first). The collectives after it have their own timeout.
START_TIMEOUT_S = 120.0


class RankLost(RuntimeError):
    """A tensor-parallel rank's process exited: the engine cannot step without it."""


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

    @classmethod
    def of(cls, req: Req) -> ReqSpec:
        return cls(
            req.rid,
            list(req.origin_input_ids),
            req.params,
            req.seed,
            req.stop_token_ids,
            req.grammar is not None,
        )


Command = tuple[Any, ...]  # ("add", ReqSpec) | ("abort", rid) | ("flush",) | ("step",) | ("stop",)


class ReplicatedScheduler(Scheduler):
    """Rank 0's scheduler: records what changes it, and sends that to the other ranks
    with each step (they replay it on their own schedulers, `run_rank`)."""

    def __init__(
        self, *args: Any, tp: TPGroup, ranks: list[multiprocessing.process.BaseProcess], **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.tp = tp
        self.ranks = ranks
        self._log: list[Command] = []

    def add_request(self, req: Req) -> None:
        self._log.append(("add", ReqSpec.of(req)))
        super().add_request(req)

    def abort(self, rid: str) -> bool:
        self._log.append(("abort", rid))
        return super().abort(rid)

    def flush_cache(self) -> bool:
        self._log.append(("flush",))
        return super().flush_cache()

    def step(self) -> list[StepOutput]:
        self._send(("step",))
        return super().step()

    def stop_ranks(self, timeout_s: float = 30.0) -> None:
        """Tell the other ranks to exit, and wait for them."""
        if any(p.is_alive() for p in self.ranks):
            try:
                self._send(("stop",))
            except RankLost:
                pass
        for proc in self.ranks:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()

    def _send(self, last: Command) -> None:
        for rank, proc in enumerate(self.ranks, start=1):
            if not proc.is_alive():
                raise RankLost(
                    f"tensor-parallel rank {rank} exited (code {proc.exitcode}); "
                    "the engine cannot go on without it"
                )
        commands, self._log = [*self._log, last], []
        self.tp.broadcast_object(commands)


def build_scheduler(
    config: EngineConfig,
    runner: ModelRunner,
    detokenize: Detokenize,
    scheduler_class: type[Scheduler] = Scheduler,
    **extra: Any,
) -> Scheduler:
    """The scheduler over `runner`'s pools, with the prefix cache the config asks for."""
    cache: PrefixCache = (
        NaiveCache(runner.kv_pool) if config.disable_radix_cache else RadixCache(runner.kv_pool)
    )
    pools: tuple[Runner, KVPool, ReqToTokenPool] = (runner, runner.kv_pool, runner.req_pool)
    return scheduler_class(
        config, *pools, cache, runner.context_len, detokenize=detokenize, **extra
    )


def start_ranks(
    config: EngineConfig, init_method: str, timeout_s: float = START_TIMEOUT_S
) -> list[multiprocessing.process.BaseProcess]:
    """Start ranks 1 .. tp_size - 1 (each joins the group at `init_method`) and wait
    until each runs: one that exits first (its main module failed to import, say) is an
    error now, not a wait in the group's rendezvous for its timeout."""
    context = multiprocessing.get_context("spawn")  # no forked CUDA or thread state
    kwargs = dataclasses.asdict(config)
    ranks: list[multiprocessing.process.BaseProcess] = []
    started: list[Any] = []  # multiprocessing Events: set by each rank as it starts
    try:
        for rank in range(1, config.tp_size):
            started.append(context.Event())
            proc: multiprocessing.process.BaseProcess = context.Process(
                target=run_rank,
                args=(kwargs, rank, init_method, os.getpid(), started[-1]),
                name=f"radixserve-tp{rank}",
                daemon=True,
            )
            proc.start()
            ranks.append(proc)
        _wait_started(ranks, started, timeout_s)
    except BaseException:
        for proc in ranks:
            proc.kill()
        raise
    return ranks


def _wait_started(
    ranks: list[multiprocessing.process.BaseProcess], started: list[Any], timeout_s: float
) -> None:
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
    kwargs: dict[str, Any], rank: int, init_method: str, parent_pid: int, started: Any
) -> None:
    """A rank other than 0: build its shard, then replay rank 0's commands until "stop"."""
    started.set()  # the main module imported: start_ranks stops watching for an early exit
    _exit_with_parent(parent_pid)
    config = EngineConfig.from_kwargs(**kwargs)
    torch.manual_seed(config.random_seed)
    device = resolve_device(config.device)
    tp = init_tp_group(rank, config.tp_size, init_method, device)
    runner: ModelRunner | None = None
    try:
        runner = ModelRunner(config, tp)
        tokenizer = load_tokenizer(runner.model_path)
        grammars = GrammarBackend(tokenizer, runner.vocab_size)
        scheduler = build_scheduler(
            config, runner, lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))
        )
        while _apply(tp.broadcast_object(None), scheduler, grammars):
            pass
    finally:
        if runner is not None:  # its graphs' captured all-reduces would hold the teardown
            runner.close()
        destroy_tp_group(tp)


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
            scheduler.step()
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
    )
    if spec.constrained:
        compiled = grammars.compile_request(spec.params)
        assert compiled is not None, "a constrained request without a grammar"
        req.grammar = grammars.new_state(compiled, req.stop_token_ids, req.params)
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
