"""Point-to-point tensors: send, recv, their asynchronous forms, sendrecv and batches.

Peers are world ranks (members of ``process_set`` when one is given); messages travel
on the group's own point-to-point communicators (:mod:`._p2p_channels`), so they never
meet a collective's, and each message carries a header the receiver checks
(:mod:`._p2p_protocol`): a shape, dtype or name other than the receive expected is a
:class:`~ringtrain.errors.MessageMismatchError` on both ranks, never a truncated
message. Tensors: numpy arrays, torch CPU tensors (bfloat16 included), and device
tensors through host memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from .base._buffers import DeviceTensor, device_tensor, is_torch_tensor, torch_from_host, torch_view
from .base._checks import in_place_array, input_array
from .base._executor import Handle
from .base._group import Group
from .base._ops import COPY_DTYPES, check_dtype
from .config import current_settings
from .errors import InvalidArgumentError, UnsupportedDtypeError, subject
from .p2p._p2p_progress import PROGRESS, Outcome, PeerHandle
from .p2p._p2p_header import Expectation, Header
from .p2p._p2p_plans import ReceivePlan, SendPlan
from .p2p._p2p_protocol import Operation, ReceiveOperation, SendOperation
from .transport._p2p_channels import Channels, channels_of
from .world._plan_cache import PlanCache
from .world._process_sets import ProcessSet, resolve_group


ANY_SOURCE = -1
"""``src=ANY_SOURCE``: a receive that takes a message from whichever rank sends one
first (with its tag); its handle's ``source`` then says which world rank that was."""


@dataclasses.dataclass(frozen=True)
class SendOp:
    """A send in a :func:`batch_isend_irecv`.

    Attributes:
        tensor: the data (numpy array, torch tensor or device tensor).
        dst: world rank of the receiver.
        tag: matches the receive's tag (0 to MPI's ``TAG_UB``).
        name: names the tensor in errors; a receive that gives a name checks it.
    """

    tensor: Any
    dst: int
    tag: int = 0
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class RecvOp:
    """A receive in a :func:`batch_isend_irecv`.

    Attributes:
        tensor: where the data goes (its shape and dtype are checked against the
            sender's), or None for a new array of the sender's shape and dtype.
        src: world rank of the sender, or :data:`ANY_SOURCE`.
        tag: matches the send's tag.
        name: the name the sender must have given (None: any).
        like: with ``tensor=None``, a tensor whose kind and device the result takes (a
            torch tensor, a device tensor); default a numpy array.
    """

    tensor: Any = None
    src: int = 0
    tag: int = 0
    name: str | None = None
    like: Any = None


def send(tensor: Any, dst: int, tag: int = 0, name: str | None = None,
         process_set: ProcessSet | None = None) -> None:
    """Send ``tensor`` to rank ``dst``; returns once the receiver has accepted it.

    Args:
        tensor: numpy array, torch tensor (CPU or CUDA) or other device tensor; any
            shape, 0-d and empty included, of a dtype the collectives move.
        dst: world rank of the receiver (a member of ``process_set``).
        tag: told apart from other messages between the same ranks by it (0 to MPI's
            ``TAG_UB``); messages with the same tag arrive in the order they were sent.
        name: names the tensor in errors; a receive that gives a name checks it.
        process_set: the ranks this message travels among (default: all).

    Raises:
        MessageMismatchError: the receive expected another shape, dtype or name (raised
            on both ranks).
        InvalidArgumentError: a bad rank or tag, or a blocking send to this rank itself
            (it would wait for its own receive: use :func:`sendrecv` or :func:`isend`).
    """
    array = _plannable(tensor, dst, tag)
    if array is not None:
        _plan(_SEND_PLANS, SendPlan, "send", array, dst, tag, name, process_set).run(array)
    else:
        PROGRESS.complete(_send_operation(tensor, dst, tag, name, process_set, Outcome))


def isend(tensor: Any, dst: int, tag: int = 0, name: str | None = None,
          process_set: ProcessSet | None = None) -> Handle:
    """Start sending ``tensor`` (see :func:`send`); its handle is done once the receiver
    has accepted it (:func:`synchronize` returns None). ``tensor`` must not change until
    then."""
    return batch_isend_irecv([SendOp(tensor, dst, tag, name)], process_set)[0]


def recv(tensor: Any = None, src: int = 0, tag: int = 0, name: str | None = None,
         process_set: ProcessSet | None = None, *, like: Any = None) -> Any:
    """Receive a tensor from rank ``src``.

    Args:
        tensor: where the data goes (returned): the sender's shape and dtype must be
            its own; or None for a new tensor of the sender's shape and dtype.
        src: world rank of the sender (a member of ``process_set``), or
            :data:`ANY_SOURCE` for the first message with ``tag`` from any rank.
        tag: the send's tag.
        name: the name the sender must have given (None accepts any).
        process_set: the ranks this message travels among (default: all).
        like: with ``tensor=None``, a tensor whose kind and device the result takes (a
            torch tensor: a torch CPU tensor; a device tensor: one on its device).

    Returns:
        ``tensor`` filled, or the new tensor (a numpy array unless ``like`` says).

    Raises:
        MessageMismatchError: the sender sent another shape, dtype or name (raised on
            both ranks; ``tensor`` is untouched).
        InvalidArgumentError: a bad rank or tag, or a blocking receive from this rank
            itself.
    """
    array = None if tensor is None or src == ANY_SOURCE else _plannable(tensor, src, tag)
    if array is not None and array.flags.writeable:
        _plan(_RECEIVE_PLANS, ReceivePlan, "recv", array, src, tag, name, process_set).run(array)
        return tensor
    return PROGRESS.complete(_receive_operation(tensor, src, tag, name, like, process_set,
                                                Outcome))


def irecv(tensor: Any = None, src: int = 0, tag: int = 0, name: str | None = None,
          process_set: ProcessSet | None = None, *, like: Any = None) -> Handle:
    """Start receiving (see :func:`recv`); :func:`synchronize` on the handle returns
    what :func:`recv` returns, and the handle's ``source`` is the sender's world rank
    (for ``src=ANY_SOURCE``, once the message has arrived)."""
    return batch_isend_irecv([RecvOp(tensor, src, tag, name, like)], process_set)[0]


def sendrecv(tensor: Any, dst: int, src: int | None = None, recv_tensor: Any = None,
             tag: int = 0, name: str | None = None, process_set: ProcessSet | None = None,
             *, like: Any = None) -> Any:
    """Send ``tensor`` to ``dst`` and receive from ``src`` (default ``dst``) at once
    (no deadlock whatever the peers' order; ``dst`` and ``src`` may be this rank).

    The received tensor must carry the same ``tag`` and, if ``name`` is given, the same
    name; it goes into ``recv_tensor``, or a new tensor as :func:`recv` makes one.

    Returns:
        The received tensor.
    """
    source = dst if src is None else src
    handles = batch_isend_irecv([SendOp(tensor, dst, tag, name),
                                 RecvOp(recv_tensor, source, tag, name, like)], process_set)
    return _wait_all(handles)[1]


def batch_isend_irecv(operations: Sequence[SendOp | RecvOp],
                      process_set: ProcessSet | None = None) -> list[Handle]:
    """Post several sends and receives at once; one handle each, in order.

    Every operation is checked before any is posted, and all are moved together while
    any of their handles is waited for, so a batch completes whatever order the peers
    posted theirs in (a ring shifting both ways, a pipeline stage receiving from one
    neighbour while sending to the other). Sends to the same rank with the same tag
    arrive in the batch's order.

    Raises:
        InvalidArgumentError, UnsupportedDtypeError: a bad operation (nothing posted).
    """
    prepared = [_prepare(operation, process_set) for operation in operations]
    PROGRESS.post(prepared)
    return [operation.handle for operation in prepared]


def _plannable(tensor: Any, peer: Any, tag: Any) -> np.ndarray | None:
    """The host array with which a blocking call takes a kept plan (:mod:`._p2p_plans`):
    a C-contiguous numpy array, or the memory of a contiguous torch CPU tensor, with a
    peer and a tag that are plain ints; else None (the general path)."""
    if type(peer) is not int or type(tag) is not int:
        return None
    if type(tensor) is np.ndarray:
        return tensor if tensor.flags.c_contiguous else None
    if is_torch_tensor(tensor) and tensor.is_cpu and tensor.is_contiguous():
        try:
            return torch_view(tensor, "send", None)
        except UnsupportedDtypeError:  # the general path says so, naming the call
            return None
    return None


P = TypeVar("P", SendPlan, ReceivePlan)


def _plan(plans: PlanCache[P], make: Callable[..., P], what: str, array: np.ndarray,
          peer: int, tag: int, name: str | None, process_set: ProcessSet | None) -> P:
    """The plan kept for a blocking ``what`` (send or recv) like this one, made (the
    call checked) if there is none."""
    key = (peer, tag, name, process_set, array.dtype, array.shape)
    plan = plans.get(key, process_set, what, name)
    if plan is None:
        route = _route(what, peer, tag, name, process_set, True)
        check_dtype(array.dtype, COPY_DTYPES, what, name)
        plan = plans.keep(key, make(resolve_group(process_set, what, name),
                                    current_settings(), route, name, array))
    return plan


_SEND_PLANS: PlanCache[SendPlan] = PlanCache()
_RECEIVE_PLANS: PlanCache[ReceivePlan] = PlanCache()


def _wait_all(handles: Sequence[Handle]) -> list[Any]:
    PROGRESS.wait(handles)
    return [handle.result() for handle in handles]


def _prepare(operation: SendOp | RecvOp, process_set: ProcessSet | None) -> Operation:
    if isinstance(operation, SendOp):
        return _send_operation(operation.tensor, operation.dst, operation.tag,
                               operation.name, process_set, PeerHandle)
    if isinstance(operation, RecvOp):
        return _receive_operation(operation.tensor, operation.src, operation.tag,
                                  operation.name, operation.like, process_set, PeerHandle)
    raise InvalidArgumentError(
        f"batch_isend_irecv takes SendOp and RecvOp, got {type(operation).__name__}")


def _send_operation(tensor: Any, dst: Any, tag: Any, name: Any,
                    process_set: ProcessSet | None,
                    handle_type: type[PeerHandle | Outcome]) -> SendOperation:
    """A checked send; a blocking one (``Outcome``) must not be to this rank."""
    route = _route("send", dst, tag, name, process_set, handle_type is Outcome)
    return SendOperation(handle_type("send", name), *route, _send_data(tensor, name))


def _receive_operation(tensor: Any, src: Any, tag: Any, name: Any, like: Any,
                       process_set: ProcessSet | None,
                       handle_type: type[PeerHandle | Outcome]) -> ReceiveOperation:
    """A checked receive; a blocking one (``Outcome``) must not be from this rank."""
    route = _route("recv", src, tag, name, process_set, handle_type is Outcome)
    expectation, target, finish = _receive_into(tensor, name, like)
    handle = handle_type("recv", name)
    if src != ANY_SOURCE:
        handle.source = route[2]
    return ReceiveOperation(handle, *route, expectation, target, finish)


def _route(what: str, peer: Any, tag: Any, name: Any, process_set: ProcessSet | None,
           blocking: bool) -> tuple[Channels, int, int, int, int]:
    """The channels, the peer's group and world ranks, this rank's world rank and the
    tag of a message, checked."""
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(f"{subject(what, None)}: name must be a str, got {name!r}")
    group = resolve_group(process_set, what, name)
    channels = channels_of(group)
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
        raise InvalidArgumentError(
            f"{subject(what, name)}: the peer must be a rank (int), got {peer!r}")
    peer = int(peer)
    if peer == ANY_SOURCE and what == "recv":
        peer_rank = MPI.ANY_SOURCE
    else:
        peer_rank = _group_rank(group, peer, what, name)
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or \
            not 0 <= tag <= channels.tag_limit:
        raise InvalidArgumentError(
            f"{subject(what, name)}: tag must be an int from 0 to {channels.tag_limit}, "
            f"got {tag!r}")
    if blocking and peer_rank == group.rank:
        raise InvalidArgumentError(
            f"{subject(what, name)}: a blocking {what} with this rank itself would wait "
            f"forever for its own {'recv' if what == 'send' else 'send'}; use sendrecv, "
            f"or isend/irecv and synchronize")
    return channels, peer_rank, peer, group.world_rank, int(tag)


def _group_rank(group: Group, peer: int, what: str, name: str | None) -> int:
    try:
        return group.world_ranks.index(peer)
    except ValueError:
        raise InvalidArgumentError(
            f"{subject(what, name)}: rank {peer} is not among the ranks "
            f"{list(group.world_ranks)} of this call") from None


def _send_data(tensor: Any, name: str | None) -> np.ndarray:
    """The bytes to send: a host array (a device tensor copied to the host)."""
    if isinstance(tensor, np.ndarray):
        array = tensor
    else:
        on_device = device_tensor(tensor, "send", name)
        array = _host_copy(on_device) if on_device is not None else \
            input_array(tensor, "send", name)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    check_dtype(array.dtype, COPY_DTYPES, "send", name)
    return array


def _receive_into(tensor: Any, name: str | None, like: Any) -> tuple[Expectation, Any, Any]:
    """What the receive accepts, where its data goes and how it is returned."""
    if tensor is None:
        on_device = None if like is None else device_tensor(like, "recv", name)
        return Expectation(None, None, name), _new_array, _new_result(like, on_device)
    on_device = device_tensor(tensor, "recv", name, in_place=True)
    if on_device is not None:
        check_dtype(on_device.dtype, COPY_DTYPES, "recv", name)
        return (Expectation(on_device.shape, on_device.dtype, name),
                lambda header: np.empty(header.shape, header.dtype),
                lambda array: _into_device(on_device, array))
    array = in_place_array(tensor, "recv", name)
    check_dtype(array.dtype, COPY_DTYPES, "recv", name)
    if array.flags.c_contiguous:
        return Expectation(array.shape, array.dtype, name), lambda header: array, \
            lambda _: tensor
    staging = np.empty(array.shape, array.dtype)

    def copy_back(received: np.ndarray) -> Any:
        array[...] = received
        return tensor

    return Expectation(array.shape, array.dtype, name), lambda header: staging, copy_back


def _new_array(header: Header) -> np.ndarray:
    return np.empty(header.shape, header.dtype)


def _new_result(like: Any, on_device: DeviceTensor | None) -> Any:
    if on_device is not None:
        def to_device(array: np.ndarray) -> Any:
            from .memory._staging import to_device as copy_up  # loads numba.cuda: device only
            from .base._buffers import results_like
            restore = results_like(like)
            result = copy_up(on_device, array)
            return result if restore is None else restore(result)
        return to_device
    if like is not None and is_torch_tensor(like):
        return torch_from_host
    return lambda array: array


def _host_copy(tensor: DeviceTensor) -> np.ndarray:
    from ..kernels import device  # loads numba.cuda: device tensors only
    host = np.empty(tensor.shape, tensor.dtype)
    if tensor.nbytes:
        with device.on_device(tensor.device):
            tensor.wait_for_producer()
            device.copy_to_host(device.byte_view(tensor.memory), host.reshape(-1).view(np.uint8))
    return host


def _into_device(tensor: DeviceTensor, array: np.ndarray) -> Any:
    from ..kernels import device  # loads numba.cuda: device tensors only
    if array.size:
        with device.on_device(tensor.device):
            target = device.byte_view(tensor.memory)
            device.copy_to_device(array.reshape(-1).view(np.uint8), target)
            device.synchronize(target)
    return tensor.owner
