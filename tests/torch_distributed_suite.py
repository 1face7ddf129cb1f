"""Run PyTorch's own DistributedTest suite against a backend ("accord" or "gloo").

    python tests/torch_distributed_suite.py [--backend accord] [--world 2]
        [-k PATTERN ...] [--open-gates | --no-open-gates] [--list] [-v]

The suite is the one torch ships in its wheel,
torch/testing/_internal/distributed/distributed_test.py (DistributedTest.
_DistTestBase: 285 tests), run the way torch's own
test/distributed/test_distributed_spawn.py runs it: a TestDistBackend per
test, each rank a spawned process that calls init_process_group(BACKEND) over
a file:// store. Nothing installed is edited and none of torch's code is
copied here.

Gates. The suite decides what to run from the backend's name. For a backend
other than gloo/nccl/ucc, two kinds of gate are opened, in memory only:

- torch's feature sets (DistTestCases.backend_feature: "subgroup", "ddp",
  "plugin"; what torch offers third-party backends) get the name;
- with --open-gates (the default for accord), the decorators that skip a test
  unless BACKEND is "gloo" (`skip_but_pass_in_sandcastle_if(BACKEND !=
  "gloo", ...)`, `require_backend_is_available({"gloo"})`) also let the
  backend through: the module's source is read from the wheel, those decorator
  expressions rewritten, and the result compiled as the module torch imports.
  Checks inside test bodies are left as they are, but for the one that picks
  DDP's CPU code path by name (`if BACKEND == "mpi" or BACKEND == "gloo":`).
  The object-collective tests gated on torch's "gpu" feature set ({"nccl",
  "gloo", "ucc"}) while their bodies use CUDA only for nccl (all_gather_object,
  gather_object: CPU_BODIED_GPU_GATED) get the backend in that one decorator;
  the "gpu" set itself is left alone, so CUDA tests stay closed;
- with --profiling (also the default for accord), the backend joins torch's
  lists of backends whose calls the profiler shows (PROFILING_SUPPORTED_
  BACKENDS and the send/recv one), so the suite's profiler checks run.

Prints one line per test with -v, and at the end the counts:
`ran N: passed P, failed F, errors E, skipped S`. Exit status 0 when nothing
failed. The whole suite at world 2 takes minutes (each test starts `world`
fresh interpreters).
"""
import argparse
import importlib.util
import os
import re
import sys
import unittest

MODULE = "torch.testing._internal.distributed.distributed_test"
GATED = ("skip_but_pass_in_sandcastle_if(", "require_backend_is_available(")
# tests gated on torch's "gpu" feature set ({"nccl", "gloo", "ucc"}) whose bodies
# touch CUDA only when BACKEND is "nccl" (a CUDA tensor added to the objects):
# for any other backend they are CPU tests, and their gate is a gate on the name
CPU_BODIED_GPU_GATED = ("test_all_gather_object_default_pg", "test_all_gather_object_subgroup",
                        "test_gather_object", "test_gather_object_subgroup")
GPU_GATE = 'DistTestCases.backend_feature["gpu"]'


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=os.environ.get("BACKEND", "accord"))
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    p.add_argument("-k", action="append", default=[], metavar="PATTERN",
                   help="run only tests whose name contains PATTERN (repeatable)")
    p.add_argument("--open-gates", dest="open_gates", action="store_true", default=None)
    p.add_argument("--no-open-gates", dest="open_gates", action="store_false")
    p.add_argument("--profiling", dest="profiling", action="store_true", default=None)
    p.add_argument("--no-profiling", dest="profiling", action="store_false")
    p.add_argument("--list", action="store_true", help="list the selected tests and exit")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def open_decorator_gates(source: str, backend: str) -> str:
    """The suite's source with its "gloo only" decorator gates also passing `backend`.

    Decorator expressions are rewritten (the lines from `@skip_but_pass_in_
    sandcastle_if(` or `@require_backend_is_available(` to their closing
    parenthesis): `BACKEND != "gloo"` becomes a test that is false for both names,
    and a set `{"gloo", ...}` of required backends gains `backend`; so is the one
    body-level `if BACKEND == "mpi" or BACKEND == "gloo":` (DDP's CPU path).
    The "gpu" feature-set gate is opened only on the tests of CPU_BODIED_GPU_GATED
    (CPU tests for every backend but nccl); the other tests gated on it stay closed.
    """
    lines = source.split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("@") and any(g in line for g in GATED):
            span, depth = [], 0
            while True:
                span.append(lines[i])
                depth += lines[i].count("(") - lines[i].count(")")
                if depth <= 0 or i + 1 >= len(lines):
                    break
                i += 1
            text = "\n".join(span)
            if _decorated(lines, i) in CPU_BODIED_GPU_GATED:
                text = text.replace(GPU_GATE, f'({GPU_GATE} | {{"{backend}"}})')
            text = text.replace('BACKEND != "gloo"',
                                f'(BACKEND != "gloo" and BACKEND != "{backend}")')
            text = re.sub(r'require_backend_is_available\(\{([^}]*)"gloo"([^}]*)\}\)',
                          lambda m: f'require_backend_is_available({{{m.group(1)}"gloo", '
                                    f'"{backend}"{m.group(2)}}})', text)
            out.extend(text.split("\n"))
        else:
            # the one body-level choice of the CPU code path by name (DDP's
            # accumulate-gradients helper): gloo's path is the CPU one
            out.append(line.replace('if BACKEND == "mpi" or BACKEND == "gloo":',
                                    f'if BACKEND in ("mpi", "gloo", "{backend}"):'))
        i += 1
    return "\n".join(out)


def _decorated(lines, i):
    """The name of the function defined at or after line i (its decorators' target)."""
    for line in lines[i:]:
        m = re.match(r"\s*def (\w+)", line)
        if m:
            return m.group(1)
    return None


def load_suite(backend: str, world: int, open_gates: bool, profiling: bool = False):
    """Import torch's DistributedTest module for `backend` (gates opened as asked;
    profiling: the suite checks the backend's profiler events)."""
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world)
    import torch.distributed as dist
    if backend.upper() not in dist.Backend._plugins and backend not in ("gloo", "nccl", "mpi"):
        import accord.torch  # noqa: F401  (when accord is on the path but not installed)
    from torch.testing._internal import common_distributed
    if backend not in ("gloo", "nccl", "ucc", "mpi"):
        for feature in ("subgroup", "ddp", "plugin"):
            common_distributed.DistTestCases.backend_feature[feature].add(backend)
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    spec = importlib.util.find_spec(MODULE)
    if open_gates:
        with open(spec.origin) as f:
            source = open_decorator_gates(f.read(), backend)
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE] = module
        exec(compile(source, spec.origin, "exec"), module.__dict__)
    else:
        module = importlib.import_module(MODULE)
    if profiling:
        for name in ("PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            listed = getattr(module, name)
            if backend not in listed:
                listed.append(backend)
    return module


# the test class must be importable by spawned ranks: built when this file runs as the
# main script (spawn re-runs it as __mp_main__, with the same environment)
_ARGS = _parse(sys.argv[1:]) if __name__ in ("__main__", "__mp_main__") else None
if _ARGS is not None:
    _open = _ARGS.open_gates if _ARGS.open_gates is not None else \
        _ARGS.backend not in ("gloo", "nccl", "ucc", "mpi")
    _prof = _ARGS.profiling if _ARGS.profiling is not None else _open
    if __name__ == "__mp_main__":        # a rank: the parent's choice, not the default
        _open = os.environ.get("ACCORD_SUITE_OPEN_GATES") == "1"
        _prof = os.environ.get("ACCORD_SUITE_PROFILING") == "1"
    os.environ["ACCORD_SUITE_OPEN_GATES"] = "1" if _open else "0"
    os.environ["ACCORD_SUITE_PROFILING"] = "1" if _prof else "0"
    _dt = load_suite(_ARGS.backend, _ARGS.world, _open, _prof)

    class TestDistBackendWithSpawn(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
        """torch's DistributedTest, one spawned process per rank (as torch runs it)."""

        def setUp(self):
            super().setUp()
            self._spawn_processes()


class _Counts(unittest.TextTestResult):
    pass


def main() -> int:
    """Select, run and count; 0 when nothing failed."""
    loader = unittest.TestLoader()
    names = sorted(n for n in loader.getTestCaseNames(TestDistBackendWithSpawn))
    if _ARGS.k:
        names = [n for n in names if any(k in n for k in _ARGS.k)]
    if _ARGS.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(verbosity=2 if _ARGS.verbose else 1,
                                     resultclass=_Counts, stream=sys.stdout)
    r = runner.run(suite)
    skipped = len(r.skipped)
    failed, errors = len(r.failures) + len(r.unexpectedSuccesses), len(r.errors)
    passed = r.testsRun - skipped - failed - errors - len(r.expectedFailures)
    print(f"\nbackend {_ARGS.backend}, world {_ARGS.world}, gates "
          f"{'opened' if os.environ['ACCORD_SUITE_OPEN_GATES'] == '1' else 'as torch has them'}, "
          f"profiler checks {'on' if os.environ['ACCORD_SUITE_PROFILING'] == '1' else 'off'}: "
          f"ran {r.testsRun}: passed {passed}, failed {failed}, errors {errors}, "
          f"skipped {skipped}")
    for kind, items in (("FAILED", r.failures), ("ERROR", r.errors)):
        for test, _ in items:
            print(f"{kind} {test.id().rsplit('.', 1)[-1]}")
    return 0 if r.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
