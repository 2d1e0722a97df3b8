"""The communicator: ``init``, ``shutdown`` and the rank/size queries."""

from __future__ import annotations

import atexit
import dataclasses
import os

from mpi4py import MPI

from ...common.environment import (STOP_JOB_ON_EXCEPTION, TIMELINE, TIMELINE_MERGED_BY_LAUNCHER,
                                   horovod_lines)
from ...common.excepthook import install_unless_replaced
from ...kernels import set_host_threads
from .. import timeline
from ..base._activity import ACTIVITY
from ..base._executor import Executor
from ..base._group import Group
from ..config import current_settings
from ..cuda_aware import CudaAwareness, cuda_awareness, query_mpi_library
from ..errors import MismatchError, NotInitializedError, set_rank
from ..gpu_choice import GPU_CHOICE_VARIABLE, GpuChoice, choose_gpu
from ..logs import LOGGER, configure_logging
from ..transport._mailboxes import open_mailboxes
from ..transport._p2p_channels import open_channels
from ..tuning import install
from ._stall import StallInspector
from ._timeline_job import finish as finish_timeline
from ._timeline_job import merge_at_exit
from ._tuning_load import agree_on_table, job_key, read_tuning_file


@dataclasses.dataclass
class World:
    """What :func:`init` sets up.

    Attributes:
        group: all ranks, on ringtrain's own communicator.
        local_comm: the ranks on this node (a shared-memory split).
        cross_comm: the ranks with the same local rank, one per node.
        executor: orders every collective of this process.
        generation: counts inits, so process sets know when to rebuild their communicators.
        process_set_groups: the communicators built for process sets, freed at shutdown.
        node_keys: for each rank, the lowest rank on its node (names the node).
        cuda_aware: whether MPI takes device pointers (see :mod:`.cuda_aware`).
        gpu: the device this rank uses, made current at init by local rank unless the
            user already chose one (see :mod:`.gpu_choice`).
        cores_shared: whether this node runs more ranks than this process may use
            cores: a rank waiting for another in a point-to-point call then soon gives
            its core away.
    """

    group: Group
    local_comm: MPI.Comm
    cross_comm: MPI.Comm
    executor: Executor
    generation: int
    process_set_groups: list[Group] = dataclasses.field(default_factory=list)
    stall_inspector: StallInspector | None = None
    node_keys: tuple[int, ...] = ()
    cuda_aware: CudaAwareness = CudaAwareness(False, "not asked")
    gpu: GpuChoice = GpuChoice(None, "not asked")
    cores_shared: bool = False


_world: World | None = None
_generation = 0
_threads_end_at_exit = False

EXIT_WAIT_SECONDS = 30.0
"""How long a process leaving without :func:`shutdown` waits at exit for its queued
collectives to finish."""


def init(comm: MPI.Comm | None = None) -> None:
    """Start ringtrain on ``comm`` (default: all of ``MPI.COMM_WORLD``).

    ringtrain communicates on a duplicate of ``comm``, so its messages never meet the
    user's. Calling ``init`` again while initialized does nothing.

    Args:
        comm: the communicator whose ranks take part; every one of its ranks must call
            ``init``.
    """
    global _world, _generation
    if _world is not None:
        return
    path = TIMELINE.read()
    if path:
        # Files are named by the job's ranks, also when ringtrain runs on a part of it.
        timeline.start_timeline(path, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
        if MPI.COMM_WORLD.Get_size() > 1 and not TIMELINE_MERGED_BY_LAUNCHER.read():
            merge_at_exit(path)
    if MPI.COMM_WORLD.Get_size() > 1 and STOP_JOB_ON_EXCEPTION.read():
        install_unless_replaced()  # a rank's unhandled exception ends the job
    base = MPI.COMM_WORLD if comm is None else comm
    own = base.Dup()
    own.Set_name("ringtrain")
    world_ranks = tuple(range(own.Get_size()))
    local_comm = own.Split_type(MPI.COMM_TYPE_SHARED, key=own.Get_rank())
    cross_comm = own.Split(color=local_comm.Get_rank(), key=own.Get_rank())
    tuning = read_tuning_file()
    gathered = own.allgather((local_comm.allreduce(own.Get_rank(), MPI.MIN), tuning.exchanged))
    node_keys = tuple(node for node, _ in gathered)
    _generation += 1
    group = Group(own, world_ranks)
    open_channels(group)
    open_mailboxes(group)
    _world = World(group, local_comm, cross_comm, Executor(), _generation,
                   node_keys=node_keys, cores_shared=local_comm.Get_size() > _usable_cores())
    set_rank(own.Get_rank())
    timeline.set_world((own.Get_rank(), own.Get_size()))
    configure_logging(own.Get_rank())
    for line in horovod_lines():
        LOGGER.info("%s", line)
    ACTIVITY.reset()
    _world.stall_inspector = _start_stall_inspector(own)
    _end_threads_at_exit()
    _world.cuda_aware = _cuda_awareness()
    try:
        _world.gpu = choose_gpu(local_comm.Get_rank())
    except ValueError as error:
        LOGGER.warning("%s; choosing by local rank", error)
        _world.gpu = choose_gpu(local_comm.Get_rank(), {GPU_CHOICE_VARIABLE: "1"})
    LOGGER.info("GPU: %s", _world.gpu)
    # Ranks on one node share its cores: parallel host kernels take their share only.
    set_host_threads(max(1, _usable_cores() // local_comm.Get_size()))
    try:
        agree_on_table(tuning, [found for _, found in gathered], job_key(node_keys))
    except MismatchError:
        shutdown()  # on every rank alike: init may be called again
        raise


def _cuda_awareness() -> CudaAwareness:
    try:
        answer = cuda_awareness()
    except ValueError as error:
        LOGGER.warning("%s; asking the MPI library instead", error)
        answer = query_mpi_library()
    LOGGER.info("CUDA-aware MPI: %s", answer)
    return answer


def _start_stall_inspector(own: MPI.Comm) -> StallInspector | None:
    if own.Get_size() == 1:
        return None
    # Every rank duplicates, whatever its settings say: Dup is collective.
    comm = own.Dup()
    settings = current_settings()
    check_seconds, shutdown_seconds = settings.stall_check_seconds, settings.stall_shutdown_seconds
    if check_seconds == 0 and shutdown_seconds == 0:
        comm.Free()
        return None
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        LOGGER.warning("the stall inspector is off: MPI was initialized without "
                       "MPI_THREAD_MULTIPLE (leave mpi4py.rc.thread_level at 'multiple')")
        comm.Free()
        return None
    return StallInspector(comm, ACTIVITY, check_seconds or shutdown_seconds,
                          shutdown_seconds)


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def shutdown() -> None:
    """Finish queued collectives and release ringtrain's communicators.

    MPI itself stays initialized (mpi4py finalizes it at exit), so ``init`` may be
    called again.
    """
    global _world
    world = _world
    if world is None:
        return
    world.executor.close()
    if world.stall_inspector is not None:
        world.stall_inspector.stop()
    finish_timeline()
    timeline.stop_timeline()
    install(None)
    _world = None
    set_rank(None)
    timeline.set_world(None)
    if not MPI.Is_finalized():
        for group in world.process_set_groups:
            group.free()
        world.cross_comm.Free()
        world.local_comm.Free()
        world.group.free()


def _end_threads_at_exit() -> None:
    """Have the collectives and stall-inspector threads end before the interpreter
    finalizes when the program leaves without :func:`shutdown` (registered once).

    Both are daemon threads. Left running, the collectives thread may drop the last
    reference to a framework's tensor while Python finalizes; a torch tensor's
    destructor takes the GIL back from C++, and a thread taking the GIL then is ended
    by the interpreter in the middle of C++ frames, which aborts the whole process
    (exit code 6 at the end of a run that succeeded). The communicators stay as they
    are: freeing them would wait for ranks that may have left.
    """
    global _threads_end_at_exit
    if not _threads_end_at_exit:
        atexit.register(_end_threads)
        _threads_end_at_exit = True


def _end_threads() -> None:
    world = _world
    if world is None:
        return
    if not world.executor.close(EXIT_WAIT_SECONDS):
        LOGGER.warning("exiting with collectives still running after %.0f s; they are left "
                       "unfinished", EXIT_WAIT_SECONDS)
        return
    if world.stall_inspector is not None and not MPI.Is_finalized():
        world.stall_inspector.stop()
        world.stall_inspector = None


def is_initialized() -> bool:
    """Whether :func:`init` has been called (and :func:`shutdown` not since)."""
    return _world is not None


def world() -> World:
    """The state set up by :func:`init`; raises :class:`NotInitializedError` before it."""
    if _world is None:
        raise NotInitializedError("ringtrain is not initialized: call ringtrain.init() first")
    return _world


def rank() -> int:
    """This process's rank among all of ringtrain's ranks."""
    return world().group.rank


def size() -> int:
    """Number of ranks."""
    return world().group.size


def cores_shared() -> bool:
    """Whether this node runs more ranks than this process may use cores (False before
    :func:`init`)."""
    return _world is not None and _world.cores_shared


def local_rank() -> int:
    """This process's rank among the ranks on its node."""
    return world().local_comm.Get_rank()


def local_size() -> int:
    """Number of ranks on this process's node."""
    return world().local_comm.Get_size()


def cross_rank() -> int:
    """This node's index among the nodes (the rank among ranks with the same local rank)."""
    return world().cross_comm.Get_rank()


def cross_size() -> int:
    """Number of nodes that have a rank with this process's local rank."""
    return world().cross_comm.Get_size()


def mpi_thread_serialized() -> bool:
    """Whether MPI allows calls from more than one thread, one at a time
    (``MPI_THREAD_SERIALIZED`` or better: the asynchronous collectives need it)."""
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED
