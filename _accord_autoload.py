"""Makes the torch.distributed backend "accord" known at `import torch`, lazily.

torch calls every entry point of the group "torch.backends" at the end of
`import torch` (unless TORCH_DEVICE_BACKEND_AUTOLOAD=0). accord's entry point is
`register` below: it names the backend "accord" to torch.distributed (already
imported by then) with a creator that imports accord.torch only when a group
is made, so `init_process_group("accord")` works in any program, torchrun
workers, spawned processes and frameworks that create the group themselves
included, with no `import accord.torch`. A program that never makes an accord
group pays the entry point's scan, which torch makes anyway, and a few
dictionary look-ups: accord itself is not imported.

This module lives outside the accord package on purpose: importing anything
inside `accord` runs accord/__init__.py (tens of milliseconds). It must never
raise: an error here would break `import torch` for every program in the
environment.
"""
import sys

BACKEND_NAME = "accord"


def _create(common_opts, backend_options=None):
    """torch's creator for "accord": import the backend on first use, then build the group."""
    from accord import torch as accord_torch
    return accord_torch.create_group(common_opts, backend_options)


def register() -> None:
    """The "torch.backends" entry point: register "accord" if torch.distributed is there.

    Does nothing when torch was built without distributed support, when accord
    is already registered, or on any error at all.
    """
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available():
            return
        backend = dist.Backend
        if BACKEND_NAME.upper() in backend._plugins:
            return
        backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    except Exception:       # noqa: BLE001 (see the module's docstring)
        pass
