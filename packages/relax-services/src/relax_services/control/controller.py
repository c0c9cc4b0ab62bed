"""The controller of one run: starts Ray (or joins a cluster), builds the pipeline, feeds prompts, watches
health and restarts failed services, writes metrics, shows progress, and ends with plots and a summary."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any, cast

from relax_core import dump_config
from relax_services.config import FaultSpec, RunConfig
from relax_services.control.checkpoint import CheckpointManager
from relax_services.control.checkpointing import Checkpointing
from relax_services.control.fault_injection import FaultInjector
from relax_services.control.global_restart import GlobalRestarts
from relax_services.control.pipeline import build_pipeline
from relax_services.control.preflight import make_run_dir
from relax_services.control.run_result import CheckpointWriteError, RunResult, final_ledger
from relax_services.control.scaling import ReplicaScaling
from relax_services.control.warmup_cache import format_warmup_task
from relax_services.data.feeder import PromptFeeder
from relax_services.data.prompts import HeldoutReport, HeldoutSet
from relax_services.data.run_data import WarmupItem, data_report, finish_heldout, prepare_data, warmup_items
from relax_services.data.synthetic import with_synthetic_files
from relax_services.faults.actor_watch import ActorWatch
from relax_services.faults.health import HealthManager, ServiceGaveUpError
from relax_services.hosting.ray_init import init_ray, wait_gone
from relax_services.reporting.metrics import MetricsWriter
from relax_services.reporting.plots import plot_run
from relax_services.reporting.progress import Progress, ProgressState
from relax_services.reporting.samples import write_eval_samples
from relax_services.reporting.sinks import SinkFanout, open_sinks
from relax_services.rows import prompt_key_of

__all__ = ["CheckpointWriteError", "Controller", "RunResult", "init_ray", "make_run_dir"]


class Controller(Checkpointing, GlobalRestarts, FaultInjector, ReplicaScaling):
    """Drives one run to its end (steps, time limit, target reward, or a signal).

    Its checkpoints (:class:`~relax_services.control.checkpointing.Checkpointing`), global restarts
    (:class:`~relax_services.control.global_restart.GlobalRestarts`), fault injection
    (:class:`~relax_services.control.fault_injection.FaultInjector`) and replica scaling
    (:class:`~relax_services.control.scaling.ReplicaScaling`) are in modules of their own; this class owns the
    state they read and the run's loop that calls them.
    """

    pipeline_builder = staticmethod(build_pipeline)  # the colocated mode's controller builds in-process services
    prompts_here = False  # prompts built by the Rollout workers and the Evaluator: this process imports no torch

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        resume: bool = False,
        resume_changes: dict[str, tuple[object, object]] | None = None,
        started_at: float | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume = resume
        self.resume_changes = dict(resume_changes or {})
        # The run's one clock (time limit, progress, summary, metrics' wall): monotonic seconds since the command
        # started (``started_at``, e.g. the CLI's first line) or since now; a resumed run adds its earlier time.
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl", start_time=started_at)
        self.resumed_from_s = 0.0
        self.startup: dict[str, float] = {}
        self._error: str | None = None
        self._stop_reason: str | None = None
        self.latest_eval: dict[str, float] = {}
        self.eval_version = -1
        self.first_eval: dict[str, float] = {}  # the run's earliest evaluation (the summary compares the final with it)
        self.first_eval_version = -1
        self.target_version: int | None = None  # the version whose evaluation met trainer.target_reward
        self.step = 0
        self.samples = 0
        self.wait_s = 0.0
        self.train_s = 0.0
        self.rollout_s = 0.0
        self.staleness: dict[int, int] = {}
        self.reached: dict[str, float] = {}
        self._last_train: dict[str, Any] = {}
        # (index in cfg.faults, fault): the index is recorded with each injection, so a resumed run skips the
        # faults the earlier run already injected (_drop_fired_faults).
        self._faults_pending = list(enumerate(cfg.faults))
        self._restart_faults: list[tuple[int, FaultSpec]] = []  # armed ``during_restart`` faults: the next restart
        self.watch = ActorWatch({})  # the pipeline's queue, store and monitor actors (set with each pipeline)
        self.nodes: dict[str, str] = {}
        self._checkpoint_step = 0
        self._checkpoint_time = time.monotonic()
        self.global_restarts = 0

    def request_stop(self, reason: str) -> None:
        """Asks the run's loop to stop (it ends at its next check); the first ``reason`` given is the one recorded."""
        if self._stop_reason is None:
            self._stop_reason = reason

    # ------------------------------------------------------------------ records
    def _ingest(self, record: dict[str, Any]) -> None:
        kind = record.pop("kind")
        if kind == "skipped":  # a Rollout worker could not read a row's media
            self.feeder.mark_skipped(record["prompt_key"], record["reason"])
        elif kind in ("train", "filtered"):  # the sample keys of a consumed batch name their prompts' keys
            self.feeder.mark_consumed(sorted({prompt_key_of(k) for k in record.pop("keys")}))
        if kind == "train":
            self.step = max(self.step, int(record["step"]))
            self.samples += int(record["samples"])
            self.wait_s += float(record["wait_s"])
            self.train_s += float(record["train_s"])
            for k, v in record["staleness_hist"].items():
                self.staleness[int(k)] = self.staleness.get(int(k), 0) + int(v)
            self._last_train = record
        elif kind == "filtered":  # a batch of uniformly scored groups (algorithm.filter_groups): consumed, not trained
            self.samples += int(record["rows"])
        elif kind == "eval":
            version = int(record["version"])
            if version >= self.eval_version:
                self.eval_version = version
                self.latest_eval = dict(record["reward"])
                self.feeder.observe(self.latest_eval, momentum=0.0)
            if self.first_eval_version < 0 or version < self.first_eval_version:
                self.first_eval_version, self.first_eval = version, dict(record["reward"])
            record["chance"] = self.data.chance
            write_eval_samples(self.run_dir, version, self.step, record.pop("samples", []))
        elif kind == "rollout":
            self.rollout_s += float(record["seconds"])
        self._observe_waits(kind, record)
        self.metrics.write(kind, record)

    def _poll_services(self) -> None:
        for records in self.health.collect_reports(self.pipeline).values():
            for record in records:
                self._ingest(record)

    # ------------------------------------------------------------------ main loop
    def run(self) -> RunResult:
        """Runs the whole run: writes its config, prepares the data and the warm-up, starts (or, resuming, restores)
        the services, drives the updates, evaluations, checkpoints and faults until the run's end or a stop request
        (SIGINT / SIGTERM included), then writes a final checkpoint and evaluation.

        Returns:
            The run's result: steps, wall time, why it stopped, final evaluation and chance levels, the sample
            ledger, health events, staleness histogram and timings.
        """
        cfg = self.cfg
        self._phase("imports_and_ray")  # from the command (``started_at``) to here: imports and Ray's start
        config_text = dump_config(cfg)
        (self.run_dir / "config.yaml").write_text(config_text, encoding="utf-8")
        sinks = open_sinks(cfg.metrics.sinks, self.run_dir, cfg.model_dump(mode="json"), config_text, cfg.metrics)
        self.metrics.sinks = SinkFanout(sinks)
        cfg = self.cfg = with_synthetic_files(cfg)  # the default run's tasks as dataset files, read as a user's
        self.data = prepare_data(cfg, self.run_dir, build_heldout=self.prompts_here)
        cfg = self.cfg = self._warmup(cfg)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints)
        self.health = HealthManager(cfg.health, self.metrics)
        restore = self.checkpoints.latest() if self.resume else None
        if self.resume and restore is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {self.checkpoints.folder}")
        if restore is not None:  # the time budget counts the time the run already spent
            self.resumed_from_s = float(self.checkpoints.load_controller(restore).get("elapsed_s", 0.0))
            self.metrics.start -= self.resumed_from_s
            self.metrics.write(
                "resume", {"from": str(restore), "changes": {k: list(v) for k, v in self.resume_changes.items()}}
            )
        self._phase("data_and_warmup")
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, lambda signum, _frame: self.request_stop(f"signal {signal.Signals(signum).name}"))
        final: dict[str, float] = {}
        final_version: int | None = None
        try:
            try:
                self._start_pipeline(restore)
            except Exception as exc:  # an actor died while the run started: start again (from its checkpoint)
                self._global_restart(self._restart_cause(exc))
            self._open_scaling()  # `relax scale` reaches the run from here on
            with Progress(cfg.run.progress) as progress:
                while True:
                    try:
                        self._loop(progress)
                        break
                    except Exception as exc:  # the trainer, a service that kept failing, or an actor died
                        self._global_restart(self._restart_cause(exc))
            self.feeder.stop()  # nothing new is generated after the final checkpoint: its ledger is the run's
            try:
                # Graceful end (and SIGINT/SIGTERM): the run can be resumed from here. The trainer stays held, so
                # the final evaluation scores exactly the checkpointed version the summary reports.
                self._checkpoint(hold=True)
            except Exception as exc:
                cause = self._restart_cause(exc)
                self.health.record_event("final_checkpoint_skipped", "trainer", reason=str(cause))
            final, final_version = self._final_eval()
        except CheckpointWriteError as exc:  # e.g. the disk is full: stop, and still write what can be written
            self._error = str(exc)
            self.request_stop("checkpoint write failed")
            final, final_version = dict(self.latest_eval), (self.eval_version if self.eval_version >= 0 else None)
        except ServiceGaveUpError as exc:  # recovery is impossible: say what failed, what was kept, how to go on
            self._error = self._gave_up_message(exc)
            self.request_stop("gave up")
            final, final_version = dict(self.latest_eval), (self.eval_version if self.eval_version >= 0 else None)
        finally:
            self._close_scaling()
            self.health.settle()
            self._stop_parts()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        wall = self.clock()
        ledger = final_ledger(self.checkpoints, self.feeder.ledger if "feeder" in vars(self) else None)
        fed = "feeder" in vars(self)  # not when the run gave up before its first start succeeded
        skipped = {"train": dict(self.feeder.skipped) if fed else {}, "heldout": dict(self.data.skipped_heldout)}
        data = data_report(self.data)
        self.metrics.write(
            "summary",
            {
                "final_eval": final,
                "ledger": ledger,
                "stop_reason": self._stop_reason,
                **({} if self._error is None else {"error": self._error}),
                "skipped_media": skipped,
                **({} if data is None else {"data": data}),
            },
        )
        self.metrics.close()
        try:
            plot_run(self.run_dir)
        except OSError as exc:  # a full disk must not hide the run's result
            self._error = self._error or f"plots not written: {exc}"
        return RunResult(
            run_dir=self.run_dir,
            steps=self.step,
            wall_s=wall,
            stop_reason=self._stop_reason or "finished",
            final_eval=final,
            final_version=final_version,
            first_eval=self.first_eval,
            first_eval_version=self.first_eval_version if self.first_eval_version >= 0 else None,
            target_reward=cfg.trainer.target_reward,
            target_version=self.target_version,
            chance=self.data.chance,
            ledger=ledger,
            health_events=self.health.events,
            samples=self.samples,
            trainer_wait_s=self.wait_s,
            train_s=self.train_s,
            rollout_s=self.rollout_s,
            staleness_hist=dict(sorted(self.staleness.items())),
            first_step_reaching=self.reached,
            warmup_steps=cfg.trainer.warmup_format_steps,
            service_nodes=self.nodes,
            skipped_media=skipped,
            data=data,
            service_pids=self._service_pids(),
            resume_changes=self.resume_changes,
            resumed_from_s=self.resumed_from_s,
            startup=dict(self.startup),
            error=self._error,
        )

    def clock(self) -> float:
        """Seconds of this run so far on its one clock (a resumed run's earlier time included)."""
        return time.monotonic() - self.metrics.start

    def time_left_s(self) -> float | None:
        """Seconds left of ``trainer.max_minutes`` (None: no limit), on the run's one clock: counted from the
        command (``started_at``), start-up included, a resumed run's earlier time too. The run stops at the first
        check (every 0.25 s) where this is <= 0, that is once the clock reaches 60 × ``max_minutes``."""
        limit = self.cfg.trainer.max_minutes
        return None if limit is None else 60 * limit - self.clock()

    def _phase(self, name: str) -> None:
        """Record that start-up phase ``name`` ended now (the summary prints the start-up phases)."""
        if name not in self.startup:
            self.startup[name] = round(self.clock() - self.resumed_from_s, 2)

    def _start_pipeline(self, restore: Path | None) -> None:
        """Build and start the services, from a checkpoint folder when given (else from step 0). In a global
        restart, the armed ``during_restart`` faults land once the queues are restored, and the restart is complete
        only when every queue, store and monitor actor still answers.

        The queue, store and monitor actors are watched while the services start, so one that died meanwhile is
        acted on at once, not after every service imported and built its model.

        Raises:
            ActorLost: one of those actors died while the services started (or, in a global restart, before the
                restart completed).
        """
        cfg = self.cfg
        here, there = (self.data.to_prompt, None) if self.prompts_here else (None, self.data.to_prompt)
        self.pipeline = self.pipeline_builder(cfg, self.data.heldout, restore, to_prompt=there)
        self.watch = ActorWatch(self.pipeline.actors())
        restarting = self.global_restarts > 0
        if restarting:
            for index, fault in self._restart_faults:
                self._kill_actor(fault, index)
            self._restart_faults.clear()
        queues = (self.pipeline.prompt_queue, self.pipeline.sample_queue)
        self.feeder = PromptFeeder(
            self.data.stream,
            here,
            *queues,
            cfg.algorithm.group_size,
            cfg.data.adaptive_weights,
            adaptive_floor=cfg.data.adaptive_floor,
        )
        if restore is not None:
            state = self.checkpoints.load_controller(restore)
            self.feeder.load_state_dict(state["feeder"])
            self.step = self._checkpoint_step = int(state["step"])
            self.metrics.write("health", {"event": "restored", "service": "run", "step": self.step})
            if not restarting:
                self._drop_fired_faults()
        self.pipeline.start(self.watch.poll)
        self.health.started(self.pipeline)  # grace for every new process, at the start and after a global restart
        if isinstance(self.data.heldout, HeldoutSet):  # the Evaluator built the prompts: chance levels, bad rows
            finish_heldout(self.data, cast("HeldoutReport", self._service_call("eval", "heldout_report")))
        self._phase("services_ready")
        self.nodes = self.pipeline.node_ids()
        self.feeder.start()
        if restore is None:
            self._checkpoint()  # step 0: a global restart always has somewhere to go back to
        if restarting:
            self.watch.check()

    def _service_pids(self) -> dict[str, int]:
        """The process id of each of the pipeline's services (none when no pipeline was ever built)."""
        services = self.pipeline.services if "pipeline" in vars(self) else {}
        return {name: int(spec.pid or 0) for name, spec in services.items()}

    def _warmup(self, cfg: RunConfig) -> RunConfig:
        """Run the format warm-up (once per run folder) and point every service at the warmed-up checkpoint."""
        if cfg.trainer.warmup_format_steps == 0:
            return cfg
        out = self.run_dir / "warmup_model"
        if not (out / "config.json").is_file():
            from relax_services.control.warmup_cache import load_or_run

            items = warmup_items(cfg)
            if not items:  # the warm-up teaches rows' listed answer options (extra_info.options); these list none
                return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"warmup_format_steps": 0})})
            # A warm-up of the same inputs ran before: its result is copied from the cache, no process started.
            self.metrics.write("warmup", load_or_run(cfg, items, out, lambda: self._run_warmup(cfg, items, out)))
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"source": str(out)})})

    def _run_warmup(self, cfg: RunConfig, items: list[WarmupItem], out: Path) -> dict[str, object]:
        """The warm-up in a process of its own (``max_calls=1``: it exits when done instead of idling with the
        model stack loaded, which only that process imports); returns its metrics record."""
        import ray

        task = ray.remote(num_cpus=0, max_calls=1)(format_warmup_task)
        info, node, pid = ray.get(task.remote(cfg, items, self.data.to_prompt, str(out), cfg.trainer.seed))
        if node == ray.get_runtime_context().get_node_id():
            wait_gone(pid)  # its ≈ 1 GB would otherwise overlap the services' imports: the run's peak memory
        return cast("dict[str, object]", info)

    def _service_call(self, service: str, method: str, *args: object) -> object:
        """``method(*args)`` of service ``service``, waited for (an OSError it raised is raised here as such)."""
        import ray

        try:
            return ray.get(getattr(self.pipeline.services[service].handle, method).remote(*args), timeout=600)
        except ray.exceptions.RayTaskError as exc:
            raise (exc.cause if isinstance(exc.cause, OSError) else exc) from None

    def _loop(self, progress: Progress) -> None:
        cfg = self.cfg
        last_report = -float("inf")
        self.health.precheck = self.watch.check  # a service failing because an actor died is not restarted in place
        while self._stop_reason is None:
            self._inject_faults()  # before the tick's wait: a fault due at step 0 lands before updates race past it
            time.sleep(0.25)
            self.watch.poll()
            self._poll_services()
            self.health.check(self.pipeline)
            self._scale_tick()
            if self.step > 0 and "first_update" not in self.startup:
                self._phase("first_update")
            if self._checkpoint_due():
                self._checkpoint()
            now = self.clock()
            if self.feeder.error:
                self.watch.check()  # a dead prompt queue is a global restart, not the end of the run
                raise RuntimeError(f"prompt feeder failed: {self.feeder.error}")
            if self.step >= cfg.trainer.total_steps:
                self.request_stop("total_steps reached")
            elif (left := self.time_left_s()) is not None and left <= 0:
                self.request_stop("time limit reached")
            elif self._target_reached():
                self.target_version = self.eval_version  # the summary says how the final weights compare
                self.request_stop("target reward reached")
            if now - last_report >= cfg.run.report_every_s or self._stop_reason is not None:
                last_report = now
                progress.update(self._progress_state(now))

    def _between_steps(self) -> None:
        """The loop's watching while one long operation (a replica joining or draining) holds it."""
        self.watch.poll()
        self._poll_services()
        self.health.check(self.pipeline)

    def _target_reached(self) -> bool:
        target = self.cfg.trainer.target_reward
        if target is None or not self.latest_eval:
            return False
        for task, value in self.latest_eval.items():
            if value >= 0.8 and task not in self.reached:
                self.reached[task] = round(self.clock(), 2)
        return set(self.latest_eval) >= set(self.data.chance) and min(self.latest_eval.values()) >= target

    def _progress_state(self, now: float) -> ProgressState:
        qm = self.pipeline.sample_queue.metrics()
        self.metrics.write(
            "queue",
            {
                "depth_rows": qm["depth_rows"],
                "depth_bytes": qm["depth_bytes"],
                "version": qm["version"],
                "admission": qm["admission"],
                "drops": qm.get("drops", 0),
                "requeues": qm.get("requeues", 0),
                "redeliveries": qm.get("redeliveries", 0),
            },
        )
        rate = self.samples / now if now > 0 else 0.0
        eta: float | None = None  # before the first update nothing says how long one takes
        if self.step:
            eta = (self.cfg.trainer.total_steps - self.step) * now / self.step
            if (left := self.time_left_s()) is not None:
                eta = min(eta, max(left, 0.0))
        return {
            "wall": now,
            "step": self.step,
            "total_steps": self.cfg.trainer.total_steps,
            "reward": float(self._last_train.get("reward", 0.0)),
            "eval": self.latest_eval,
            "chance": self.data.chance,
            "max_staleness": int(self._last_train.get("max_staleness", 0)),
            "depth_rows": int(qm["depth_rows"]),
            "samples_per_s": rate,
            "eta_s": eta,
            # Every service brought back, however (a host's replacement brings back each of its roles).
            "restarts": sum(e["event"] == "restarted" for e in self.health.events),
        }

    def _final_eval(self) -> tuple[dict[str, float], int | None]:
        """The held-out reward of the final weights and their version (the last evaluation if the evaluator is down)."""
        import ray

        spec = self.pipeline.services["eval"]
        try:
            version, rewards, samples = ray.get(spec.handle.evaluate_latest.remote(), timeout=300)
        except Exception:  # the evaluator is down: report the last evaluation it made
            return dict(self.latest_eval), (self.eval_version if self.eval_version >= 0 else None)
        write_eval_samples(self.run_dir, int(version), self.step, samples, final=True)
        self.metrics.write("eval", {"version": version, "reward": rewards, "chance": self.data.chance, "final": True})
        return dict(rewards), int(version)
