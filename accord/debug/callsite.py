"""Call sites: the user's file:line of each collective, and its 23-bit id.

`call_site()` names the nearest caller outside accord (and torch), cached per
code location, so it costs a few hundred nanoseconds per call. The id rides in
every message stamp (transport/wire.py), so a Desync can name the peer's line
too: the text of each id is written to the groups' stores before the first
message carrying it leaves this process.
"""
import os
import sys
import zlib

from . import groups

# the accord package (this file is accord/debug/callsite.py): its frames are not the user's,
# but for its command-line tools (accord/cli/: the benchmark workers), which are programs
# calling the library like any other
_ACCORD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CLI_DIR = _ACCORD_DIR + "cli" + os.sep
_SKIP = (_ACCORD_DIR, os.sep + "torch" + os.sep)
SITE_MASK = (1 << 23) - 1

# Keyed by id(code), not by the code object: hashing a code object hashes its
# constants and bytecode on every lookup (0.8 µs for a long function, twice a call).
# The values hold the code objects, so no id is reused while it is a key.
_sites = {}          # (id(code), offset) -> ((site id, "file:line"), code)
_site_text = {}      # site id -> "file:line"
_skip = {}           # id(code) -> (True if it is accord's (or torch's) own, code)


def call_site(depth=2):
    """(site id, 'file:line') of the nearest caller outside accord (and torch).

    Cached per (code object, bytecode offset): a few hundred nanoseconds.
    """
    try:
        f = sys._getframe(depth)
    except ValueError:
        return 0, ""
    skip = _skip
    while f is not None:
        code = f.f_code
        s = skip.get(id(code))
        if s is None:
            name = code.co_filename
            s = skip[id(code)] = (name.startswith(_SKIP[0]) and not name.startswith(_CLI_DIR)
                                  or _SKIP[1] in name, code)
        if not s[0]:
            break
        f = f.f_back
    if f is None:
        return 0, ""
    key = (id(code), f.f_lasti)
    hit = _sites.get(key)
    if hit is None:
        name, line = code.co_filename, f.f_lineno
        text = f"{os.path.basename(name)}:{line}"
        site = (zlib.crc32(f"{name}:{line}".encode()) & SITE_MASK) or 1
        hit = _sites[key] = ((site, text), code)
        if site not in _site_text:
            _site_text[site] = text
            announce([(site, text)], groups.live_groups())
    return hit[0]


def site_text(site):
    """'file:line' for a site id this process knows (peers run the same code)."""
    return _site_text.get(site)


def remember(site, text):
    """A peer's site text, read back from the store: known from now on."""
    _site_text.setdefault(site, text)


def count():
    """How many call sites this process knows (a new one republishes positions)."""
    return len(_site_text)


def known():
    """[(site id, 'file:line')] of every site this process knows so far."""
    return list(_site_text.items())


def site_key(global_rank, site):
    """The store key of a site's text, as global_rank announced it."""
    return f"debug/site/{global_rank}/{site}"


def announce(sites, to_groups):
    """Write call sites' text into the groups' stores, once per site and store.

    Messages carry only a site's id (23 bits of the header). Its text is written
    here before the first message with that id leaves this process, so a peer
    that gets the id in a Desync can always read the text back, even after this
    process has exited (the positions the publisher writes every PERIOD would
    miss a site used just before an exit).
    """
    done = set()
    for g in to_groups:
        store = getattr(g, "store", None)
        if store is None or not g.is_member or id(store) in done:
            continue
        done.add(id(store))
        for site, text in sites:
            try:
                store.set(site_key(g.global_rank, site), text)
            except Exception:       # a store that is gone: the publisher's table remains
                break
