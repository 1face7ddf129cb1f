"""The actor the Ray tests drive: one process of a ray.util.collective group.

Its methods are those of the worker in Ray's own collective tests
(ray/util/collective/tests/cpu_util.py in Ray's repository): a buffer and a
list buffer, one method per collective on them, and the group queries; plus
what accord adds (the group's transport, per-call timeouts, dying on demand).
Ray ships the class by value, so importing this module in a worker does not
happen: the backend is registered there by the job's worker_process_setup_hook
("accord.ray.register").
"""
import os
from datetime import timedelta

import numpy as np
import ray
import ray.util.collective as col
from ray.util.collective.types import AllReduceOptions, ReduceOp


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self):
        self.buffer = np.ones(10, dtype=np.float32)
        self.list_buffer = [np.ones(10, dtype=np.float32) for _ in range(2)]

    def init_group(self, world_size, rank, backend="ACCORD", group_name="default"):
        col.init_collective_group(world_size, rank, backend, group_name)
        return True

    def init_group_within(self, world_size, rank, group_name, join_s):
        """init_collective_group on ACCORD with ACCORD_RAY_JOIN_TIMEOUT=join_s in this process."""
        old = os.environ.get("ACCORD_RAY_JOIN_TIMEOUT")
        os.environ["ACCORD_RAY_JOIN_TIMEOUT"] = str(join_s)
        try:
            col.init_collective_group(world_size, rank, "ACCORD", group_name)
        finally:
            if old is None:
                del os.environ["ACCORD_RAY_JOIN_TIMEOUT"]
            else:
                os.environ["ACCORD_RAY_JOIN_TIMEOUT"] = old
        return True

    def set_buffer(self, data):
        self.buffer = data
        return True

    def get_buffer(self):
        return self.buffer

    def set_list_buffer(self, arrays, copy=False):
        if copy:
            arrays = [a.copy() if isinstance(a, np.ndarray) else a.clone() for a in arrays]
        self.list_buffer = arrays
        return True

    def do_allreduce(self, group_name="default", op=ReduceOp.SUM):
        col.allreduce(self.buffer, group_name, op)
        return self.buffer

    def do_reduce(self, group_name="default", dst_rank=0, op=ReduceOp.SUM):
        col.reduce(self.buffer, dst_rank, group_name, op)
        return self.buffer

    def do_broadcast(self, group_name="default", src_rank=0):
        col.broadcast(self.buffer, src_rank, group_name)
        return self.buffer

    def do_allgather(self, group_name="default"):
        col.allgather(self.list_buffer, self.buffer, group_name)
        return self.list_buffer

    def do_reducescatter(self, group_name="default", op=ReduceOp.SUM):
        col.reducescatter(self.buffer, self.list_buffer, group_name, op)
        return self.buffer

    def do_send(self, group_name="default", dst_rank=0):
        col.send(self.buffer, dst_rank, group_name)
        return self.buffer

    def do_recv(self, group_name="default", src_rank=0):
        col.recv(self.buffer, src_rank, group_name)
        return self.buffer

    def do_barrier(self, group_name="default"):
        col.barrier(group_name)
        return True

    def allreduce_within(self, group_name, ms):
        """An allreduce with AllReduceOptions.timeout_ms = ms, straight on the group."""
        opts = AllReduceOptions()
        opts.timeout_ms = timedelta(milliseconds=ms)
        col.get_group_handle(group_name).allreduce([self.buffer], opts)
        return self.buffer

    def destroy_group(self, group_name="default"):
        col.destroy_collective_group(group_name)
        return True

    def report_rank(self, group_name="default"):
        return col.get_rank(group_name)

    def report_world_size(self, group_name="default"):
        return col.get_collective_group_size(group_name)

    def report_is_group_initialized(self, group_name="default"):
        return col.is_group_initialized(group_name)

    def report_backend(self, group_name="default"):
        return col.get_group_handle(group_name).backend()

    def report_group(self, group_name="default"):
        """What the group runs on: backend, transport, hosts and the hierarchy's leaders."""
        handle = col.get_group_handle(group_name)
        g = handle.accord_group
        hosts = g.transport.hosts
        leaders = g.hier.leaders if g.hier is not None else None
        return {"backend": handle.backend(), "transport": type(g.transport).__name__,
                "hosts": None if hosts is None else len(set(hosts)),
                "hierarchical": g.hier is not None, "leader": leaders is not None,
                "leaders": leaders.size if leaders is not None else None,
                "node": ray.get_runtime_context().get_node_id()}

    def pid(self):
        return os.getpid()

    def die(self):
        os._exit(1)
