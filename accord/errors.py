"""The error contract: every communication failure is an AccordError.

Whose fault each is: ValueError/TypeError are the caller's (raised before any
byte moves); CommTimeout and PeerLost are the job's (a peer was slow or died);
Desync is the program's (ranks disagree about what they are doing);
GroupClosed means the group was destroyed or broken by an earlier failure;
HandshakeRefused means a peer could not prove it belongs to this job.
"""
from typing import Optional


class AccordError(RuntimeError):
    """Base of every error raised by communication (a RuntimeError, as torch's DistError).

    `except accord.AccordError` catches CommTimeout, PeerLost, Desync and
    GroupClosed. Bad arguments raise ValueError or TypeError instead, before any
    byte moves.
    """


class CommTimeout(AccordError, TimeoutError):
    """A collective did not complete before its deadline (also a TimeoutError).

    Its message has a table of where every rank of the group stands ("rank 2
    never entered all_reduce #1; ranks 0, 1 are waiting in it"). torch raises a
    bare timeout from its backend instead.
    """


class PeerLost(AccordError, ConnectionError):
    """A peer process died or left the group (also a ConnectionError).

    Raised within seconds on every rank waiting on the lost peer, whatever the
    timeout; `peer` is its rank when known. Under torch's gloo such a job hangs
    until the timeout.
    """

    def __init__(self, message: str, peer: Optional[int] = None) -> None:
        super().__init__(message)
        self.peer = peer


class Desync(AccordError):
    """Ranks called different collectives, or the same one with different arguments.

    Raised on every rank involved, naming both sides' calls and their file:line
    (also for ranks blocked in collectives of different groups: a deadlock).
    torch has no such check: mismatched calls hang or corrupt data there.
    """


class GroupClosed(AccordError):
    """The group was destroyed, or is broken by an earlier failure.

    After a collective of a group fails (PeerLost, CommTimeout, Desync), every
    later call on it raises GroupClosed naming that first error.
    """


class HandshakeRefused(AccordError):
    """A connection between two ranks failed its proof: the other end does not know the
    job's secret (ACCORD_STORE_TOKEN differs between ranks, or another process holds
    the published address), refused this rank's proof, or failed the TLS handshake.

    Raised at once by the rank that dialled, rather than after its timeout. torch's
    backends have no such check (any process that reaches the port joins).
    """


# Tracebacks and reprs name them as users spell them (accord.Desync, not
# accord.errors.Desync); pickle finds them there too.
for _cls in (AccordError, CommTimeout, PeerLost, Desync, GroupClosed):
    _cls.__module__ = "accord"
del _cls
