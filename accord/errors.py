"""The error contract: every communication failure is an AccordError.

Whose fault each is: ValueError/TypeError are the caller's (raised before any
byte moves); CommTimeout and PeerLost are the job's (a peer was slow or died);
Desync is the program's (ranks disagree about what they are doing);
GroupClosed means the group was destroyed or broken by an earlier failure.
"""


class AccordError(RuntimeError):
    """Base of every error raised by communication."""


class CommTimeout(AccordError, TimeoutError):
    """A collective did not complete before its deadline."""


class PeerLost(AccordError, ConnectionError):
    """A peer process died or closed its connection."""

    def __init__(self, message, peer=None):
        super().__init__(message)
        self.peer = peer


class Desync(AccordError):
    """Ranks called different collectives, or the same one with different arguments."""


class GroupClosed(AccordError):
    """The group was destroyed, or is broken by an earlier failure."""


# Tracebacks and reprs name them as users spell them (accord.Desync, not
# accord.errors.Desync); pickle finds them there too.
for _cls in (AccordError, CommTimeout, PeerLost, Desync, GroupClosed):
    _cls.__module__ = "accord"
del _cls
