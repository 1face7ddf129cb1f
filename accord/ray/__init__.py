"""accord on Ray: the ray.util.collective backend "ACCORD".

    import accord.ray                      # registers "ACCORD" with ray.util.collective
    import ray.util.collective as col
    col.init_collective_group(world_size, rank, backend="ACCORD", group_name="g")
    col.allreduce(array, group_name="g")

Importing this package registers the backend in the importing process. Ray
looks a backend up in the process that makes the group, so every actor that
joins an ACCORD group imports accord.ray too (at the top of the actor's
module, in its __init__, or for every worker of a job with
`ray.init(runtime_env={"worker_process_setup_hook": "accord.ray.register"})`).
`accord` itself never imports Ray; this package needs it (`pip install
accord[ray]`).

Ray Train needs nothing from here: `TorchConfig(backend="accord")` uses the
torch.distributed backend "accord", which an installed accord registers
with torch by itself.
"""
from .group import BACKEND_NAME, AccordGroup, ArgumentError

__all__ = ["AccordGroup", "ArgumentError", "BACKEND_NAME", "register"]


def register() -> None:
    """Register backend "ACCORD" with ray.util.collective in this process; idempotent.

    Also usable as Ray's `worker_process_setup_hook` ("accord.ray.register"),
    so that every worker process of a job has it.
    """
    from ray.util.collective.backend_registry import BackendRegistry, register_collective_backend
    if not BackendRegistry().is_registered(BACKEND_NAME):
        register_collective_backend(BACKEND_NAME, AccordGroup)


register()
