"""What each role runs: its command line and environment, defined once for both ways a run is started.

A run has three roles — rollout server, trainer, orchestrator — and two launchers: ``rlrun local``
(processes on this machine, :mod:`rlrun.launcher.local`) and the operator (pods,
:mod:`rlrun_operator.builders`). Both build each role's command here; they hand in what differs
between them — the program (``rlrun`` on a pod's ``PATH``, ``python -m rlrun`` locally), the
manifest, run directory and model cache paths, ports and addresses — and nothing else. The
canonical order of a role command is ``<program> <role> MANIFEST --run-dir … --cache-dir …
--attempt N [--run-uid U] [--max-steps N] [--resume]`` then the role's own options.

The trainer's process shape is decided here too, for both launchers: one rank runs :func:`trainer_command` as it
is; more (:func:`under_torchrun`: ``nodes × processes_per_node`` > 1) run it under torchrun (:func:`trainer_argv`).

The environment a role needs from its launcher: the orchestrator's bearer token in
:data:`CONTROL_TOKEN_ENV`; a trainer under torchrun, :data:`TORCHRUN_SHUTDOWN_TIMEOUT_ENV` set to its
grace period (:func:`trainer_env`). A rollout role serves rlrun's stand-in for vLLM when its environment says so
(:data:`FAKE_ROLLOUT_ENV`, :func:`fake_rollout`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

#: The orchestrator's control server reads its bearer token from here (``rlrun orchestrator --control-port``).
CONTROL_TOKEN_ENV = "RLRUN_CONTROL_TOKEN"
#: The trainer's ``/metrics`` and ``/healthz`` port (unset: none; :mod:`rlrun.training.prometheus`).
METRICS_PORT_ENV = "RLRUN_METRICS_PORT"
#: The trainer pod's IP, from the downward API (``spec.weights.transport: collective``): where the rollout servers'
#: workers reach rank 0's weight sender (:mod:`rlrun.training.weight_sender`; unset: 127.0.0.1).
POD_IP_ENV = "RLRUN_POD_IP"
#: The vLLM weight-transfer backend of rlrun's gloo engine (``--weight-transfer-config '{"backend": "rlrun_gloo"}'``;
#: registered in vLLM's factories by rlrun's ``vllm.general_plugins`` entry point, :mod:`rlrun.rollout.vllm_plugin`).
GLOO_BACKEND = "rlrun_gloo"
#: torchrun's wait between forwarding SIGTERM to its ranks and killing them (seconds; its default is 30).
#: torch >= 2.12 reads it (pytorch/pytorch#172596; checked with 2.13); older torch ignores it and always
#: waits 30 s. An environment variable, not ``--shutdown-timeout``: older torchrun would refuse the
#: unknown argument and the trainer would never start.
TORCHRUN_SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: ``rlrun rollout`` serves rlrun's stand-in for vLLM (:mod:`rlrun.rollout.fake`) when this is true (its ``--fake``).
FAKE_ROLLOUT_ENV = "RLRUN_FAKE_ROLLOUT"
#: The values of a boolean option's variable that mean true, as the command line reads them (click's).
TRUE_VALUES = ("1", "true", "t", "yes", "y", "on")
#: The ``rlrun`` console script, as an image has it on its ``PATH``.
RLRUN = ("rlrun",)
#: torchrun's console script.
TORCHRUN = ("torchrun",)


def _common(
    program: Sequence[str],
    role: str,
    manifest: str,
    run_dir: str,
    cache_dir: str | None,
    attempt: int,
    run_uid: str,
    max_steps: int | None,
    resume: bool,
) -> list[str]:
    argv = [*program, role, manifest, "--run-dir", run_dir]
    argv += ["--cache-dir", cache_dir] if cache_dir else []
    argv += ["--attempt", str(attempt)]
    argv += ["--run-uid", run_uid] if run_uid else []
    argv += ["--max-steps", str(max_steps)] if max_steps is not None else []
    return [*argv, "--resume"] if resume else argv


def rollout_command(
    manifest: str, cache_dir: str | None, host: str, port: int, program: Sequence[str] = RLRUN
) -> list[str]:
    """``rlrun rollout``: a rollout server for the manifest's model on ``host:port``. vLLM's own argv (tensor
    parallelism over the pod's GPUs, dtype, ``rollout.vllm_args``) is decided by that command from the manifest
    (:func:`rlrun.rollout.server.vllm_command`), so it too is one definition for both launchers.

    Args:
        cache_dir: the model cache (None: the command's default, ``$RLRUN_CACHE_DIR``).
        program: what runs ``rlrun`` (:data:`RLRUN`, or ``[sys.executable, "-m", "rlrun"]``).
    """
    argv = [*program, "rollout", manifest]
    argv += ["--cache-dir", cache_dir] if cache_dir else []
    return [*argv, "--host", host, "--port", str(port)]


def fake_rollout(env: Mapping[str, str]) -> bool:
    """Whether ``rlrun rollout`` run with environment ``env`` serves the fake (:data:`FAKE_ROLLOUT_ENV` true, as
    ``--fake`` reads it), not vLLM."""
    return env.get(FAKE_ROLLOUT_ENV, "").strip().lower() in TRUE_VALUES


def trainer_command(
    manifest: str,
    run_dir: str,
    cache_dir: str | None,
    attempt: int,
    *,
    resume: bool,
    run_uid: str = "",
    max_steps: int | None = None,
    program: Sequence[str] = RLRUN,
) -> list[str]:
    """``rlrun trainer``: one trainer process (or, under :func:`torchrun_command`, each rank's).

    Args:
        attempt: the attempt number (a trainer-only restart keeps it; see :mod:`rlrun.training.trainer`).
        resume: ``--resume`` (from the newest complete checkpoint).
        run_uid: the run's uid (``--run-uid``: attempts numbered per run directory); "" leaves it out.
        max_steps: ``--max-steps`` (None: the spec's).
    """
    return _common(program, "trainer", manifest, run_dir, cache_dir, attempt, run_uid, max_steps, resume)


def orchestrator_command(
    manifest: str,
    run_dir: str,
    cache_dir: str | None,
    attempt: int,
    *,
    resume: bool,
    control_port: int,
    control_host: str | None = None,
    rollout_urls: Sequence[str] = (),
    run_uid: str = "",
    max_steps: int | None = None,
    program: Sequence[str] = RLRUN,
) -> list[str]:
    """``rlrun orchestrator``: the orchestrator, its control server on ``control_host:control_port``
    (None: the command's default, loopback) with the token in :data:`CONTROL_TOKEN_ENV`.

    Args:
        rollout_urls: the rollout servers (none: it waits for ``PUT /rollout-endpoints``, as on a cluster).
        resume, run_uid, max_steps, program: as for :func:`trainer_command`.
    """
    argv = _common(program, "orchestrator", manifest, run_dir, cache_dir, attempt, run_uid, max_steps, resume)
    argv += [a for url in rollout_urls for a in ("--rollout-url", url)]
    argv += ["--control-host", control_host] if control_host else []
    return [*argv, "--control-port", str(control_port)]


def torchrun_command(
    command: Sequence[str],
    processes_per_node: int,
    nodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    rendezvous_timeout_s: int | None = None,
    launcher: Sequence[str] = TORCHRUN,
) -> list[str]:
    """``command`` (a :func:`trainer_command` whose program is a script: torchrun's ``--no-python``) as
    ``processes_per_node`` data-parallel ranks on each of ``nodes`` nodes.

    One node: ``torchrun --standalone --nnodes 1 --nproc-per-node P``. Several: a static rendezvous,
    ``--nnodes N --nproc-per-node P --node-rank R --master-addr A --master-port M --rdzv-conf
    timeout=T``. Both ``--max-restarts 0``: a failed rank fails the trainer, whose launcher decides.
    torchrun hands each rank ``RANK``, ``WORLD_SIZE`` (``N × P``), ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``.

    Args:
        launcher: what runs torchrun (:data:`TORCHRUN`, or ``[sys.executable, "-m", "torch.distributed.run"]``).

    Raises:
        ValueError: several nodes without ``master_addr``/``master_port``.
    """
    ranks = ["--nnodes", str(nodes), "--nproc-per-node", str(processes_per_node)]
    if nodes == 1:
        launch = [*launcher, "--standalone", *ranks]
    else:
        if master_addr is None or master_port is None:
            raise ValueError("a trainer on several nodes needs the rendezvous address and port")
        launch = [*launcher, *ranks, "--node-rank", str(node_rank), "--master-addr", master_addr]
        launch += ["--master-port", str(master_port)]
        launch += ["--rdzv-conf", f"timeout={rendezvous_timeout_s}"] if rendezvous_timeout_s else []
    return [*launch, "--max-restarts", "0", "--no-python", *command]


def under_torchrun(processes_per_node: int, nodes: int = 1) -> bool:
    """Whether a trainer of ``nodes × processes_per_node`` ranks runs under torchrun: more than one rank. One rank
    runs :func:`trainer_command` as it is (no torchrun, no process group), whichever launcher starts it; what signals
    it and reads its exit status follows from this too (torchrun forwards a signal to its ranks and exits with its own
    status: ``rlrun.launcher.processes.role_exit_code``)."""
    return nodes * processes_per_node > 1


def trainer_argv(
    command: Sequence[str],
    processes_per_node: int,
    nodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    rendezvous_timeout_s: int | None = None,
    launcher: Sequence[str] = TORCHRUN,
) -> list[str]:
    """The trainer's argv: ``command`` (a :func:`trainer_command`) as it is for one rank, else under
    :func:`torchrun_command` (whose arguments these are; :func:`under_torchrun` decides).

    Raises:
        ValueError: several nodes without ``master_addr``/``master_port``.
    """
    if not under_torchrun(processes_per_node, nodes):
        return list(command)
    return torchrun_command(
        command, processes_per_node, nodes, node_rank, master_addr, master_port, rendezvous_timeout_s, launcher
    )


def trainer_env(processes_per_node: int, grace_s: float, nodes: int = 1) -> dict[str, str]:
    """What the trainer's environment needs besides its launcher's: under torchrun (:func:`under_torchrun`),
    :data:`TORCHRUN_SHUTDOWN_TIMEOUT_ENV` = the trainer's grace period (seconds, rounded up), so the ranks' save on
    notice is cut short only by the launcher's own SIGKILL, never by torchrun's 30 s default."""
    return {TORCHRUN_SHUTDOWN_TIMEOUT_ENV: str(math.ceil(grace_s))} if under_torchrun(processes_per_node, nodes) else {}
