"""accord: collective communication for Python processes.

The torch.distributed programming model (process groups, broadcast,
all_gather, scatter and the rest) over TCP and shared memory, with or
without PyTorch. The public names are those in `accord.__all__`; each one's
docstring says how it differs from torch.distributed. `import accord.torch`
registers the "accord" backend with torch.distributed.
"""
from .api import (
    all_gather, all_gather_into_tensor, all_to_all, all_to_all_single, barrier, gather, irecv,
    isend, recv, reduce_scatter, reduce_scatter_tensor, scatter, send, P2POp, batch_isend_irecv,
)
# broadcast, all_reduce and reduce are the api's, routed through an open coalescing() block
from .coalescing import all_reduce, broadcast, coalescing, reduce
from .elastic import admit, agree, shrink
from .errors import AccordError, CommTimeout, Desync, GroupClosed, PeerLost
from .group import ProcessGroup
from .monitored import monitored_barrier
from .objects import (all_gather_object, broadcast_object_list, gather_object,
                      scatter_object_list)
from .reduceops import ReduceOp
from .state import broadcast_state
from .work import Work
from .world import (
    destroy_process_group, get_global_rank, get_group_rank, get_process_group_ranks, get_rank,
    get_world_size, init_process_group, is_initialized, new_group, new_subgroups,
)

__version__ = "0.1.0"

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "new_group", "new_subgroups", "get_group_rank", "get_global_rank",
    "get_process_group_ranks",
    "broadcast", "all_gather", "all_gather_into_tensor", "scatter", "gather", "reduce",
    "all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "P2POp",
    "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "scatter_object_list", "gather_object",
    "broadcast_state", "coalescing", "shrink", "agree", "admit",
    "ReduceOp", "Work", "ProcessGroup",
    "AccordError", "CommTimeout", "PeerLost", "Desync", "GroupClosed",
]
