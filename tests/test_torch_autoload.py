"""Installing accord makes init_process_group("accord") work with no `import accord.torch`.

The package declares an entry point in torch's group "torch.backends", which
torch calls at `import torch`. These tests build the package's metadata from
pyproject.toml (setuptools egg_info into a temporary directory, put first on
the path, as an installed copy would be), then start fresh interpreters that
only import torch: torchrun-like and spawned ranks must find the backend, the
entry point must not import accord, and it must never raise.
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """PYTHONPATH under which accord is 'installed': its metadata and its modules."""
    meta = tmp_path_factory.mktemp("meta")
    subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "-q",
                    "egg_info", "-e", str(meta)], cwd=ROOT, check=True, capture_output=True,
                   timeout=120)
    eps = (next(meta.glob("*.egg-info")) / "entry_points.txt").read_text()
    assert "[torch.backends]" in eps and "_accord_autoload:register" in eps, eps
    return os.pathsep.join([str(meta), ROOT])


def _python(code, pythonpath, tmp_path, env=None):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code))
    e = dict(os.environ, PYTHONPATH=pythonpath, TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    e.update(env or {})
    return subprocess.run([sys.executable, str(script)], env=e, capture_output=True, text=True,
                          timeout=150, cwd=str(tmp_path))


SPAWNED = """
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def work(rank, world, path):
    assert "accord" not in sys.modules          # import torch did not import accord
    dist.init_process_group("accord", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    with open(f"{path}.{rank}", "w") as f:      # (ranks' prints would interleave)
        f.write(f"{dist.get_backend()} {type(dist.group.WORLD).__name__} {t.tolist()}")
    dist.destroy_process_group()

if __name__ == "__main__":
    print("imported", "accord" in sys.modules, "ACCORD" in dist.Backend._plugins, flush=True)
    mp.spawn(work, args=(2, sys.argv[0] + ".store"), nprocs=2)
"""


def test_spawned_ranks_find_the_backend_without_importing_accord(installed, tmp_path):
    r = _python(SPAWNED, installed, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "imported False True", r.stdout
    for rank in range(2):
        got = (tmp_path / f"prog.py.store.{rank}").read_text()
        assert got == "accord AccordProcessGroup [3.0, 3.0, 3.0]", (rank, got)


def test_without_the_metadata_the_name_is_unknown(tmp_path):
    # the same program, accord's modules on the path but not its metadata: what the
    # entry point fixes (torch does not know the name)
    r = _python(SPAWNED, ROOT + os.pathsep + "/nonexistent", tmp_path,
                env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert "imported False False" in r.stdout, r.stdout + r.stderr
    assert r.returncode != 0


def test_the_entry_point_never_raises(installed, tmp_path):
    code = """
    import sys
    import torch
    import torch.distributed as dist
    import _accord_autoload as hook

    # registered once at import torch; a second call changes nothing
    plugin = dist.Backend._plugins["ACCORD"]
    hook.register()
    assert dist.Backend._plugins["ACCORD"] is plugin
    # a torch whose registration fails, or without distributed: still no error
    del dist.Backend._plugins["ACCORD"]
    real = dist.Backend.register_backend
    def broken(*a, **k):
        raise RuntimeError("broken torch")
    dist.Backend.register_backend = broken
    hook.register()
    dist.Backend.register_backend = real
    saved = sys.modules["torch.distributed"]
    sys.modules["torch.distributed"] = None
    hook.register()
    sys.modules["torch.distributed"] = saved
    print("ok", "accord" in sys.modules, "ACCORD" in dist.Backend._plugins)
    """
    r = _python(code, installed, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok False False", r.stdout



ELASTIC = """
import sys
import torch
import torch.distributed as dist
assert "accord" not in sys.modules
dist.init_process_group("accord")              # torchrun's env://, the name found by itself
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum={t.item():g} "
      f"backend={dist.get_backend()}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_elastic_rendezvous_on_accord(installed, tmp_path):
    # torch.distributed.elastic: an elastic node range and the c10d rendezvous
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC)
    env = dict(os.environ, PYTHONPATH=installed, OMP_NUM_THREADS="1",
               TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    r = subprocess.run([torchrun, "--nnodes", "1:2", "--nproc-per-node", "2",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                        "--rdzv-id", "accord-elastic", "--rdzv-conf", "last_call_timeout=1",
                        "--monitor-interval", "0.5", "--log-dir", str(tmp_path / "logs"),
                        "--tee", "3", str(script)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(2):
        assert f"rank {rank}/2 sum=3 backend=accord" in r.stdout, r.stdout
