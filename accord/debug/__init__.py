"""Never hang, always explain: call sites, flight recorder, positions, stuck-rank reports.

Everything here is off the per-call hot path or costs a few hundred
nanoseconds on it. From the bottom up:

- groups.py: the groups this process belongs to, and which threads issue.
- callsite.py: `call_site()` names the user's file:line of a collective; its
  23-bit id rides in every message stamp, so a Desync can name the peer's line.
- recorder.py: the flight recorder of each group, its dumps, the logger.
- positions.py: where each rank stands, published to the store; the
  stuck-rank table of a timeout (`stuck_report`).
- deadlock.py: ranks blocked in different groups, each waiting for the other.
- monitor.py: the publisher thread driving positions and deadlock;
  `register(group)` joins a group to all of it.
- detail.py: ACCORD_DEBUG=DETAIL's signature check and tensor summaries.

The names below are those the rest of the package uses (the process group,
the world, chrome_trace), and `dump`, the flight recorder written on demand.
"""
from .callsite import call_site, site_text
from .groups import live_groups, on_main_thread, unregister
from .monitor import register
from .positions import peer_text, published_site_text, stuck_report
from .recorder import (DONE, ERROR, FAILED, RUNNING, SEQ, STATE, T_END, T_START, Recorder,
                       describe_entry, dump, load_dumps, on_error)

__all__ = ["call_site", "site_text", "live_groups", "on_main_thread", "unregister", "register",
           "peer_text", "published_site_text", "stuck_report", "DONE", "ERROR", "FAILED",
           "RUNNING", "SEQ", "STATE", "T_END", "T_START", "Recorder", "describe_entry", "dump",
           "load_dumps", "on_error"]
